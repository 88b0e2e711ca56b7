"""benchmarks/convergence/runs.py and references.py without training: run specs and where their
configs are found, the catalogue's references, runs of one's own compared like for like (the same
flags on both sides), and the BF16 reference taken from stored rows."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # benchmarks/ is a folder of the repository, not of the installed package

from benchmarks.convergence import __main__ as cli  # noqa: E402
from benchmarks.convergence import references as refs_module  # noqa: E402
from benchmarks.convergence import runs  # noqa: E402

CONFIGS = ROOT / "configs" / "convergence"


def _named(chosen):
    return {name: run.name for name, run in chosen.items()}


def test_every_run_of_the_default_list_has_its_bf16_reference():
    catalogue = runs.CATALOGUE
    default = [catalogue[name] for name in runs.DEFAULT_RUNS]
    named = _named(runs.references(default))
    assert set(named) == {run.name for run in default}
    assert named["bf16"] == named["fp8"] == named["fp4"] == named["bf16_repeat"] == named["fp4_dispatch"] == "bf16"
    assert named["bf16_seed2"] == named["fp8_seed2"] == named["fp4_seed2"] == "bf16_seed2"
    assert named["bf16_init2"] == "bf16"  # another init, the data order of bf16
    assert runs.role(catalogue["bf16"], catalogue["bf16"]) == "reference"
    assert runs.role(catalogue["bf16_repeat"], catalogue["bf16"]).startswith("noise: repeat")
    assert runs.role(catalogue["bf16_init2"], catalogue["bf16"]).startswith("noise: init")
    assert runs.role(catalogue["fp4"], catalogue["bf16"]) == "compared"
    # A run whose data order no BF16 run shares has no reference.
    assert "fp4" not in runs.references([catalogue["fp4"], catalogue["bf16_seed2"]])


def test_a_larger_proxy_is_compared_with_its_own_bf16_config():
    """configs/convergence/h512/ is another model: its runs take h512/bf16.yaml of their seed as the
    reference, never the small proxy's bf16.yaml, and the rows name the config by its folder."""
    small, large = runs.parse_run_spec("bf16 bf16 1234"), runs.parse_run_spec("bf16_h512 h512/bf16 1234")
    fp4_large, fp8_large = runs.parse_run_spec("fp4_h512 h512/fp4 1234"), runs.parse_run_spec("x h512/fp8 5678")
    assert (large.config_name, large.reference_config, large.is_bf16) == ("h512/bf16.yaml", "h512/bf16.yaml", True)
    assert (fp4_large.config_name, fp4_large.reference_config) == ("h512/fp4.yaml", "h512/bf16.yaml")
    assert small.reference_config == "bf16.yaml" and small.config_path() == CONFIGS / "bf16.yaml"
    chosen = runs.references([small, large, fp4_large, fp8_large])
    assert _named(chosen) == {"bf16": "bf16", "bf16_h512": "bf16_h512", "fp4_h512": "bf16_h512"}
    assert runs.role(fp4_large, large) == "compared" and runs.role(large, large) == "reference"
    assert "fp4_h512" not in runs.references([small, fp4_large])
    from megatron_fp4.run_config import load_config

    large_configs = sorted((CONFIGS / "h512").glob("*.yaml"))
    assert {"bf16.yaml", "fp8.yaml", "fp4.yaml", "size.yaml"} <= {path.name for path in large_configs}
    for path in large_configs:  # each is the config of its name in the folder above at the larger size
        if path.name != "size.yaml":
            flags = load_config(path).flags
            assert (flags["hidden_size"], flags["moe_ffn_hidden_size"]) == (512, 256)
            assert flags == {**load_config(path.parents[1] / path.name).flags, **flags}


def test_run_specs():
    run = runs.parse_run_spec("mine fp4 7 data_seed=1234 --lr 2e-3")
    assert (run.name, run.config, run.seed, run.data_seed, run.flags) == ("mine", "fp4", 7, 1234, ("--lr", "2e-3"))
    assert run.order == 1234 and run.config_path() == CONFIGS / "fp4.yaml"
    assert runs.parse_run_spec(runs.spec(run)) == run
    with pytest.raises(runs.RunSpecError, match="expected 'NAME CONFIG SEED"):
        runs.parse_run_spec("mine fp4")


def test_runs_of_ones_own_replace_the_default_set_unless_runs_names_more():
    """--run alone names every run (a call that meant to train two runs once started the twelve of the
    default set as well); with --runs both are taken; with neither, the default set."""
    spec = "fp4_again fp4 3456"
    alone = cli.parse_args(["train", "--run", spec])
    assert [run.name for run in alone.selected] == ["fp4_again"]
    both = cli.parse_args(["train", "--runs", "bf16,fp4", "--run", spec])
    assert [run.name for run in both.selected] == ["bf16", "fp4", "fp4_again"]
    assert [run.name for run in cli.parse_args(["train"]).selected] == list(runs.DEFAULT_RUNS)
    with pytest.raises(SystemExit):
        cli.parse_args(["train", "--runs", ""])  # nothing to run


# The call on a corpus of one's own: every run with the same seed and flags.
SPLIT = "--split 980,20,0"
OWN_DATA = [f"bf16 configs/convergence/h512/bf16.yaml 777 {SPLIT}", f"fp8 configs/convergence/h512/fp8.yaml 777 {SPLIT}",
            f"fp4 configs/convergence/h512/fp4.yaml 777 {SPLIT}"]


def test_runs_with_the_same_flags_are_compared_with_the_bf16_run_with_those_flags(monkeypatch):
    """A BF16 run with flags used to be no reference at all (only a BF16 run without flags was), so
    the FP8 and FP4 runs beside it had no comparison rows."""
    monkeypatch.chdir(ROOT)  # the paths as the issue gave them, relative to the repository
    bf16, fp8, fp4 = (runs.parse_run_spec(text) for text in OWN_DATA)
    assert bf16.config_name == "h512/bf16.yaml" and bf16.is_bf16
    chosen = runs.references([bf16, fp8, fp4])
    assert _named(chosen) == {"bf16": "bf16", "fp8": "bf16", "fp4": "bf16"}
    assert [runs.role(run, chosen[run.name]) for run in (bf16, fp8, fp4)] == ["reference", "compared", "compared"]
    # The order of the flags, and --flag=value against --flag value, do not matter.
    other_spelling = runs.parse_run_spec("fp4b h512/fp4 777 --split=980,20,0")
    assert _named(runs.references([bf16, other_spelling])) == {"bf16": "bf16", "fp4b": "bf16"}
    # A BF16 repeat with the same flags is noise, not a candidate.
    repeat = runs.parse_run_spec(f"bf16_again h512/bf16 777 {SPLIT}")
    chosen = runs.references([bf16, repeat])
    assert chosen["bf16_again"] is bf16 and runs.role(repeat, bf16).startswith("noise: repeat")


def test_a_run_is_compared_with_the_bf16_run_sharing_the_most_of_its_flags():
    plain = runs.parse_run_spec("bf16 bf16 1234")
    split = runs.parse_run_spec(f"bf16_split bf16 1234 {SPLIT}")
    lr = runs.parse_run_spec("bf16_lr bf16 1234 --lr 2e-3")
    fp4_split = runs.parse_run_spec(f"fp4_split fp4 1234 {SPLIT}")
    fp4_split_storage = runs.parse_run_spec(f"fp4_split_experts fp4 1234 {SPLIT} --moe-fp4-storage experts")
    fp4_storage = runs.parse_run_spec("fp4_experts fp4 1234 --moe-fp4-storage experts")
    fp4_other = runs.parse_run_spec("fp4_other fp4 1234 --split 900,100,0")
    chosen = _named(runs.references([plain, split, lr, fp4_split, fp4_split_storage, fp4_storage, fp4_other]))
    assert chosen == {"bf16": "bf16", "bf16_split": "bf16", "bf16_lr": "bf16", "fp4_split": "bf16_split",
                      "fp4_split_experts": "bf16_split", "fp4_experts": "bf16", "fp4_other": "bf16"}
    # Without the BF16 run without flags, a BF16 run with flags is the reference of those flags, and a
    # run whose flags are not all among a BF16 run's has none.
    chosen = _named(runs.references([split, lr, fp4_split, fp4_storage]))
    assert chosen == {"bf16_split": "bf16_split", "bf16_lr": "bf16_lr", "fp4_split": "bf16_split"}


def _final_row(case, flags, run, value):
    return {"bench": "convergence", "case": case, "metric": refs_module.FINAL_LOSS, "role": "reference",
            "config": "h512/bf16.yaml", "seed": 777, "iters": 6, "validation_sha256": "v", "corpus_sha256": "c",
            "flags": flags, "value": value, "run": run, "commit": "abc1234"}


def test_stored_references_follow_the_flags_too(tmp_path):
    rows = [_final_row("bf16", [], "2026-12-01T00:00:00Z", 1.0),
            _final_row("bf16_split", ["--split", "980,20,0"], "2026-12-02T00:00:00Z", 2.0),
            _final_row("bf16_split_old", ["--split", "980,20,0"], "2026-11-01T00:00:00Z", 3.0)]
    (tmp_path / "convergence.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))

    def found(flags, fewer_only=False):
        stored = refs_module.stored_reference(tmp_path, "h512/bf16.yaml", 777, 6, "v", "c", flags, fewer_only)
        return stored and (stored.name, stored.flags)

    assert found(["--split", "980,20,0"]) == ("bf16_split", ("--split", "980,20,0"))  # the most flags, the latest
    assert found(["--split", "980,20,0", "--moe-fp4-storage", "experts"])[0] == "bf16_split"
    assert found([]) == ("bf16", ())
    assert found(["--split", "980,20,0"], fewer_only=True) == ("bf16", ())  # a BF16 run with those flags itself
    assert found(["--split", "900,100,0"]) == ("bf16", ())
    assert refs_module.stored_reference(tmp_path, "h512/bf16.yaml", 777, 6, "w", "c") is None


def test_a_config_path_is_found_under_configs_convergence(tmp_path, monkeypatch):
    """`h512/bf16.yaml` was looked up in the working directory only, and the launch ended in a
    ConfigError traceback."""
    monkeypatch.chdir(tmp_path)
    for text in ("x h512/bf16.yaml 777", "x h512/bf16 777", "x configs/convergence/h512/bf16.yaml 777",
                 f"x {CONFIGS / 'h512' / 'bf16.yaml'} 777"):
        run = runs.parse_run_spec(text)
        assert run.config_path() == CONFIGS / "h512" / "bf16.yaml" and run.config_name == "h512/bf16.yaml", text
    (tmp_path / "mine.yaml").write_text(f"include: {CONFIGS / 'bf16.yaml'}\n")
    mine = runs.parse_run_spec("mine mine.yaml 1")
    assert mine.config == str(tmp_path / "mine.yaml") and mine.config_name == "mine.yaml"
    monkeypatch.chdir(ROOT)
    assert mine.config_path() == tmp_path / "mine.yaml"  # a config of one's own, wherever the harness is


@pytest.mark.parametrize("config", ["h512/nope.yaml", "nope"])
def test_a_config_that_does_not_exist_is_one_sentence(config, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["train", "--run", f"x {config} 777", "--dry-run"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("python -m benchmarks.convergence train: error: argument --run: run spec")
    assert f"config {config} not found: tried " in last
    assert str(CONFIGS / (config if config.endswith(".yaml") else f"{config}.yaml")) in last
