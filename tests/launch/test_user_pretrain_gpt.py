"""The lines of megatron_fp4.launch's docstring, added to copies of project-written stand-ins of
Megatron-LM's training scripts (tests/data/megatron_lm_0_19: pretrain_gpt.py, whose model the
megatron-core wheel builds from a GPTModelConfig; tests/data/megatron_lm_0_18: pretrain_gpt.py and
gpt_builders.py), against that release's wheel, on CPU: they are all that changes; our flags parse;
a refused configuration stops with one sentence; with the lines, every MoE layer of the decoder
and of the MTP layer dispatches in MXFP4 with FP8 experts and a few steps train (the census line
says so); without them (0.19) or with the decoder's line but not the MTP one (0.18), the run stops
at its first forward pass with one sentence, exit status 2."""

import difflib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support import integration_lines
from support.integration_lines import documented_blocks

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
RUNNER = ROOT / "tests" / "support" / "user_script_on_cpu.py"
MEGATRON_0_18 = ROOT / ".megatron-versions" / "0.18.2"
SMALL_MOE = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "64",
             "--max-position-embeddings", "64", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-4",
             "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--num-experts", "4"]
# Two MoE layers and one MTP layer, Megatron's local layers (no Transformer Engine here), two steps.
TRAINING = [
    "--num-layers", "2", "--hidden-size", "128", "--ffn-hidden-size", "256", "--num-attention-heads", "2",
    "--seq-length", "16", "--max-position-embeddings", "16", "--position-embedding-type", "rope",
    "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-4", "--mock-data",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--num-experts", "2", "--moe-router-topk", "2",
    "--moe-ffn-hidden-size", "128", "--moe-token-dispatcher-type", "alltoall", "--swiglu", "--disable-bias-linear",
    "--bf16", "--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
    "--no-persist-layer-norm", "--no-rope-fusion", "--distributed-backend", "gloo", "--log-interval", "1",
    "--eval-iters", "0", "--eval-interval", "1000", "--seed", "1234", "--mtp-num-layers", "1",
    "--moe-fp4-dispatch", "--moe-fp4-experts", "fp8",
]
CENSUS = "megatron_fp4: 2 of 2 MoE layers and 1 of 1 MTP layers (3 of 3 with FP8 experts): MXFP4 dispatch, FP8 experts"
REFUSAL = ("error: --moe-fp4-dispatch asks for {what}, and the model on this rank has 0 of {asked}: the training "
           "script builds Megatron's layers without megatron_fp4's layer spec; apply the lines of "
           "docs/integration.md for your Megatron-LM release.")


def _changes(before: str, after: str) -> list:
    return [line for line in difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]


def _release_folder(tmp: Path, release: str, **lines) -> Path:
    """A copy of the release's stand-in with the documented lines, in tmp/<release>."""
    (tmp / "megatron_lm_gpt_data.py").write_text((DATA / "megatron_lm_gpt_data.py").read_text())
    return integration_lines.apply(release, DATA / f"megatron_lm_{release.replace('.', '_')}", tmp / release, **lines)


def test_the_documented_lines_are_all_that_changes(tmp_path):
    folder = _release_folder(tmp_path, "0.19")
    changes = _changes((DATA / "megatron_lm_0_19" / "pretrain_gpt.py").read_text(),
                       (folder / "pretrain_gpt.py").read_text())
    assert sum(line.startswith("+") for line in changes) == 3 and len(changes) == 4, changes  # one line changed
    folder = _release_folder(tmp_path, "0.18")
    changes = _changes((DATA / "megatron_lm_0_18" / "pretrain_gpt.py").read_text(),
                       (folder / "pretrain_gpt.py").read_text())
    assert sum(line.startswith("+") for line in changes) == 2 and len(changes) == 3, changes
    changes = _changes((DATA / "megatron_lm_0_18" / "gpt_builders.py").read_text(),
                       (folder / "gpt_builders.py").read_text())
    assert changes == [f"+{documented_blocks()[0][0]}", *(f"+    {line}" for line in documented_blocks()[1])]


def _env() -> dict:
    env = {"PATH": "/usr/bin:/bin", "WORLD_SIZE": "1", "RANK": "0", "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
           # this checkout's package, also where another one is installed
           "PYTHONPATH": str(ROOT)}
    return env


def _run(script, *argv):
    return subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, timeout=300,
                          check=False, cwd=ROOT, env=_env())


@pytest.fixture
def user_script(tmp_path):
    return _release_folder(tmp_path, "0.19") / "pretrain_gpt.py"


def test_user_script_parses_our_flags(user_script):
    result = _run(user_script, "--help")
    assert result.returncode == 0, result.stderr[-2000:]
    for flag in ("--moe-fp4-dispatch", "--moe-fp4-experts {bf16,fp8}", "--moe-fp4-cache", "--num-experts"):
        assert flag in result.stdout, flag


def test_user_script_refuses_with_one_sentence(user_script):
    result = _run(user_script, *SMALL_MOE, "--moe-fp4-cache")
    assert result.returncode == 2, result.stderr[-2000:]
    # The sentence is the last line, before Megatron's argument dump (stdout stays empty); the
    # notices before it are the user's script's imports, which the plugin leaves alone.
    assert result.stderr.splitlines()[-1] == ("error: --moe-fp4-cache needs --moe-fp4-dispatch: it caches the FP4 "
                                              "dispatch's payload.")
    assert result.stdout == "" and "Traceback" not in result.stderr


# (release, the lines left out, expected exit status)
RUNS = {"0.19": ("0.19", {}, 0), "0.19 without the model-config line": ("0.19", {"spec_line": False}, 2),
        "0.18": ("0.18", {}, 0), "0.18 without the MTP line": ("0.18", {"mtp_line": False}, 2)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each of RUNS trained by its stand-in, all four processes at once: name -> (completed
    process, megatron-core version the process imported)."""
    if not (MEGATRON_0_18 / "megatron" / "core" / "package_info.py").is_file():
        why = f"megatron-core 0.18.2 is not installed in {MEGATRON_0_18}: run .ci/run"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    started = {}
    for port, (name, (release, lines, _)) in enumerate(RUNS.items(), start=29650):
        folder = _release_folder(tmp_path_factory.mktemp("run"), release, **lines)
        megatron = str(MEGATRON_0_18) if release == "0.18" else "-"
        started[name] = subprocess.Popen(
            [sys.executable, str(RUNNER), megatron, str(port), str(folder / "pretrain_gpt.py"), *TRAINING],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=_env())
    done = {}
    for name, process in started.items():
        stdout, stderr = process.communicate(timeout=600)
        done[name] = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    return done


def _iterations(stdout: str) -> list:
    return re.findall(r" iteration +(\d+)/ +2 \|.* lm loss: (\S+) \|.* mtp_1 loss: (\S+) \|", stdout)


@pytest.mark.parametrize("release", ["0.19", "0.18"])
def test_the_lines_make_every_moe_and_mtp_layer_fp4_and_it_trains(runs, release):
    result = runs[release]
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"megatron-core {release}." in result.stderr  # the release's own wheel built the model
    assert CENSUS in result.stdout.splitlines()
    steps = _iterations(result.stdout)
    assert [step for step, _, _ in steps] == ["1", "2"], result.stdout[-3000:]
    assert all(0 < float(loss) < 10 and 0 < float(mtp) < 10 for _, loss, mtp in steps)


@pytest.mark.parametrize("name, what, asked", [
    ("0.19 without the model-config line", "MoE layers dispatching in MXFP4", 2),
    ("0.18 without the MTP line", "MTP layers' MoE layers dispatching in MXFP4", 1),
])
def test_without_the_lines_the_run_stops_before_a_step(runs, name, what, asked):
    result = runs[name]
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1] == REFUSAL.format(what=what, asked=asked)
    assert _iterations(result.stdout) == [] and "Traceback" not in result.stderr
