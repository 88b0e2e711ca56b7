"""The benchmark result rows: the writer's schema, and every row already in benchmarks/results/."""

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # benchmarks/ is a folder of the repository, not of the installed package

from benchmarks import rows  # noqa: E402

RESULTS = sorted((ROOT / "benchmarks" / "results").glob("*.jsonl"))


def test_the_writer_appends_rows_of_the_schema(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_FP4_COMMIT", "abc1234")
    recorder = rows.Recorder("bench_example", gpus=2, hidden=7168)
    recorder.add("kernel", "bandwidth", 3100.0, "GB/s", "device-to-device copy", 4200.0)
    recorder.add("layer", "forward+backward", 22.5, "ms", "stock BF16 layer", 24.0, iters=20)
    assert recorder.write(tmp_path) == tmp_path / "bench_example.jsonl"
    recorder.write(tmp_path)  # appends: a second run adds lines, never rewrites
    lines = (tmp_path / "bench_example.jsonl").read_text().splitlines()
    assert len(lines) == 4
    first, second = (json.loads(line) for line in lines[:2])
    for row in (first, second):
        assert set(rows.REQUIRED) <= set(row)
        assert rows.row_problems(row) == []
        assert row["commit"] == "abc1234" and row["gpus"] == 2 and row["hidden"] == 7168
    assert first["ratio"] == pytest.approx(3100 / 4200) and first["better"] == "higher"
    assert second["ratio"] == pytest.approx(22.5 / 24.0) and second["better"] == "lower"
    assert second["iters"] == 20


def test_the_writer_refuses_rows_that_break_the_schema(tmp_path):
    info = {"gpu": "cpu", "gpus": 1, "commit": "abc1234", "date": "2026-12-01"}
    with pytest.raises(ValueError, match="nonzero"):
        rows.make_row("b", "case", "time", 1.0, "ms", "baseline", 0.0, info)
    with pytest.raises(ValueError, match="finite"):
        rows.make_row("b", "case", "time", math.nan, "ms", "baseline", 1.0, info)
    with pytest.raises(ValueError, match="better"):
        rows.make_row("b", "case", "time", 1.0, "ms", "baseline", 2.0, info, better="faster")
    with pytest.raises(ValueError, match="written to"):
        rows.append_rows("other", [rows.make_row("b", "case", "time", 1.0, "ms", "baseline", 2.0, info)], tmp_path)


def test_row_problems_names_each_fault():
    row = rows.make_row("b", "case", "time", 1.0, "ms", "baseline", 2.0,
                        {"gpu": "cpu", "gpus": 1, "commit": "abc1234", "date": "2026-12-01"})
    assert rows.row_problems({**row, "ratio": 2.0}) == ["ratio 2.0 is not value / reference_value"]
    assert rows.row_problems({**row, "date": "yesterday"}) == ["date is not YYYY-MM-DD"]
    assert rows.row_problems({k: v for k, v in row.items() if k != "unit"}) == ["missing unit"]


def test_there_are_result_files():
    assert RESULTS, "benchmarks/results/ holds no .jsonl file"


@pytest.mark.parametrize("path", RESULTS, ids=[p.name for p in RESULTS])
def test_every_stored_row_follows_the_schema(path):
    lines = path.read_text().splitlines()
    assert lines, f"{path.name} is empty"
    for number, line in enumerate(lines, 1):
        row = json.loads(line)
        problems = rows.row_problems(row)
        assert not problems, f"{path.name}:{number}: {problems}"
        assert row["bench"] == path.stem, f"{path.name}:{number}: a row of {row['bench']}"
