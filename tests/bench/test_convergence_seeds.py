"""benchmarks/convergence/seeds.py (`python -m benchmarks.convergence seeds`) on synthetic convergence rows: which rows count, the latest row of a
seed stands for it, the spread over seeds, and the training deviation from the run's curve."""

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ is a folder of the repository

from benchmarks.convergence import __main__ as cli  # noqa: E402
from benchmarks.convergence import seeds as cs  # noqa: E402
from benchmarks.convergence.references import FINAL_LOSS  # noqa: E402


def _row(config, seed, ratio, commit, **changes):
    row = {"bench": "convergence", "metric": FINAL_LOSS, "role": "compared", "status": "finished", "iters": 2000,
           "config": config, "flags": [], "seed": seed, "ratio": ratio, "value": ratio, "reference_value": 1.0,
           "commit": commit, "run": f"t-{commit}", "case": f"{config}-{seed}"}
    row.update(changes)
    return row


ROWS = [
    _row("fp4.yaml", 1, 1.010, "aaa"),
    _row("fp4.yaml", 2, 1.002, "aaa"),
    _row("fp4.yaml", 1, 1.004, "bbb"),  # the same seed on later code: stands for seed 1
    _row("fp4.yaml", 3, 1.100, "ccc", status="stopped at the budget"),
    _row("fp4.yaml", 4, 1.100, "ccc", iters=200),
    _row("fp4.yaml", 5, 1.100, "ccc", flags=["--moe-fp4-linears-grad", "bf16"]),
    _row("fp4.yaml", 6, 1.100, "ccc", role="reference"),
    _row("fp8.yaml", 1, 1.003, "aaa"),
]


def test_the_latest_row_of_each_seed_counts_and_the_spread_is_over_seeds():
    s = cs.summarize(ROWS, "fp4.yaml", 2000)
    assert [(r.seed, r.commit, r.rows) for r in s.seeds] == [(1, "bbb", 2), (2, "aaa", 1)]
    assert s.seeds[0].deviation == pytest.approx(0.004) and s.seeds[1].deviation == pytest.approx(0.002)
    assert s.final.mean == pytest.approx(0.003)
    assert s.final.sd == pytest.approx(math.sqrt(2) * 0.001)
    assert s.final.se == pytest.approx(0.001)
    assert all(math.isnan(r.training_deviation) for r in s.seeds) and math.isnan(s.training.mean)  # no curves


def _curve(run, case, ratios, role="compared"):
    return [{"run": run, "case": case, "role": role, "iteration": 10 * (i + 1), "ratio": ratio}
            for i, ratio in enumerate(ratios)]


def test_the_training_deviation_is_the_second_half_of_the_standing_rows_curve():
    """Only the curve of the row standing for the seed (its harness run and name) counts, only past
    iters / 2, and only as compared with BF16."""
    curves = (_curve("t-bbb", "fp4.yaml-1", [1.5] * 100 + [1.002, 1.004] * 50)  # iterations 10..2000
              + _curve("t-aaa", "fp4.yaml-1", [1.9] * 200)  # the earlier row of seed 1: not standing
              + _curve("t-bbb", "fp4.yaml-1", [1.9] * 200, role="reference")
              + _curve("t-aaa", "fp4.yaml-2", [1.0] * 100 + [0.999] * 100))
    s = cs.summarize(ROWS, "fp4.yaml", 2000, curves)
    assert [r.training_deviation for r in s.seeds] == pytest.approx([0.003, -0.001])
    assert s.training.mean == pytest.approx(0.001) and s.training.sd == pytest.approx(math.sqrt(2) * 0.002)
    assert math.isnan(cs.summarize(ROWS, "fp8.yaml", 2000, curves).seeds[0].training_deviation)  # no curve of its own


def test_a_setting_with_flags_counts_only_rows_with_exactly_those_flags():
    s = cs.summarize(ROWS, "fp4.yaml --moe-fp4-linears-grad bf16", 2000)
    assert [(r.seed, r.deviation) for r in s.seeds] == [(5, pytest.approx(0.1))]
    assert s.setting == "fp4.yaml --moe-fp4-linears-grad bf16"
    with pytest.raises(ValueError, match="no finished 2000-iteration rows of fp4.yaml --moe-fp4-linears-grad fp8"):
        cs.summarize(ROWS, "fp4.yaml --moe-fp4-linears-grad fp8", 2000)


def test_one_seed_has_no_spread_and_a_setting_without_rows_is_refused():
    s = cs.summarize(ROWS, "fp8.yaml", 2000)
    assert s.final.mean == pytest.approx(0.003) and math.isnan(s.final.sd) and math.isnan(s.final.se)
    with pytest.raises(ValueError, match="no finished 2000-iteration rows of bf16.yaml"):
        cs.summarize(ROWS, "bf16.yaml", 2000)


def test_command_prints_the_table(tmp_path, capsys):
    (tmp_path / "convergence.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    assert cli.main(["seeds", "--results", str(tmp_path), "--configs", "fp4.yaml"]) == 0
    out, err = capsys.readouterr()
    assert "| fp4.yaml | 1: +0.40% (bbb, 2), 2: +0.20% (aaa, 1) | +0.30% | 0.14 | 0.10 |" in out
    assert "training deviations are not known" in err
    assert "| fp4.yaml | 1: - (bbb, 2), 2: - (aaa, 1) | - | - | - |" in out  # no curves file
    curves = _curve("t-bbb", "fp4.yaml-1", [1.0] * 100 + [1.01] * 100)
    (tmp_path / "convergence_curves.jsonl").write_text("".join(json.dumps(point) + "\n" for point in curves))
    assert cli.main(["seeds", "--results", str(tmp_path), "--configs", "fp4.yaml"]) == 0
    assert "| fp4.yaml | 1: +1.00% (bbb, 2), 2: - (aaa, 1) | +1.00% | - | - |" in capsys.readouterr().out
    assert cli.main(["seeds", "--results", str(tmp_path), "--configs", "fp4.yaml --moe-fp4-linears-grad bf16"]) == 0
    assert "| fp4.yaml --moe-fp4-linears-grad bf16 | 5: +10.00% (ccc, 1) |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="does not exist"):
        cli.main(["seeds", "--results", str(tmp_path / "missing")])
    with pytest.raises(SystemExit, match="no finished"):
        cli.main(["seeds", "--results", str(tmp_path), "--configs", "none.yaml"])


def _bf16(value, seed=1, **changes):
    return _row("h512/bf16.yaml", seed, 1.0, "ddd", **{"role": "reference", "value": value, "reference_value": value,
                                                      "validation_sha256": "v", **changes})


def test_a_run_is_also_measured_against_the_mean_of_its_seeds_bf16_repeats():
    """Every finished BF16 run of the proxy's own BF16 config with the run's init, data order, length
    and validation set counts; other inits, data orders, validation sets, flags, lengths and the other
    proxy's BF16 do not; the run's own reference counts once."""
    rows = [_bf16(1.0), _bf16(1.02, run="t-eee"),
            _bf16(0.5, data_seed=7), _bf16(0.5, seed=2, data_seed=1), _bf16(0.5, validation_sha256="w"),
            _bf16(0.5, flags=["--x"]), _bf16(0.5, iters=200), _bf16(0.5, status="stopped at the budget"),
            _row("bf16.yaml", 1, 1.0, "ddd", role="reference", value=0.5, validation_sha256="v"),
            _row("h512/fp4.yaml", 1, 1.01, "fff", value=1.0302, reference_value=1.02, validation_sha256="v")]
    s = cs.summarize(rows, "h512/fp4.yaml", 2000)
    (seed,) = s.seeds
    assert sorted(seed.bf16_repeats) == [1.0, 1.02]
    assert seed.deviation == pytest.approx(0.01) and seed.repeats_deviation == pytest.approx(0.02)
    assert s.repeats.mean == pytest.approx(0.02)
    assert "| h512/fp4.yaml | 1: +2.00% (2, 1.98) | +2.00% |" in cs.table([s])
    # Without stored BF16 rows, the run's own reference is the only one.
    (alone,) = cs.summarize(rows[-1:], "h512/fp4.yaml", 2000).seeds
    assert alone.bf16_repeats == [1.02] and alone.repeats_deviation == pytest.approx(0.01)
