"""benchmarks/convergence_seeds.py on synthetic convergence rows: which rows count, the latest row of a
seed stands for it, and the spread over seeds."""

import json
import math

import pytest

from benchmarks import convergence_seeds as cs
from benchmarks.convergence_rows import FINAL_LOSS


def _row(config, seed, ratio, commit, **changes):
    row = {"bench": "convergence", "metric": FINAL_LOSS, "role": "compared", "status": "finished", "iters": 2000,
           "config": config, "flags": [], "seed": seed, "ratio": ratio, "commit": commit}
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
    assert s.mean == pytest.approx(0.003)
    assert s.sd == pytest.approx(math.sqrt(2) * 0.001)
    assert s.se == pytest.approx(0.001)


def test_one_seed_has_no_spread_and_a_setting_without_rows_is_refused():
    s = cs.summarize(ROWS, "fp8.yaml", 2000)
    assert s.mean == pytest.approx(0.003) and math.isnan(s.sd) and math.isnan(s.se)
    with pytest.raises(ValueError, match="no finished 2000-iteration rows of bf16.yaml"):
        cs.summarize(ROWS, "bf16.yaml", 2000)


def test_command_prints_the_table(tmp_path, capsys):
    (tmp_path / "convergence.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    assert cs.main(["--results", str(tmp_path), "--configs", "fp4.yaml"]) == 0
    out = capsys.readouterr().out
    assert "| fp4.yaml | 1: +0.40% (bbb, 2), 2: +0.20% (aaa, 1) | +0.30% | 0.14 | 0.10 |" in out
    with pytest.raises(SystemExit, match="does not exist"):
        cs.main(["--results", str(tmp_path / "missing")])
    with pytest.raises(SystemExit, match="no finished"):
        cs.main(["--results", str(tmp_path), "--configs", "none.yaml"])
