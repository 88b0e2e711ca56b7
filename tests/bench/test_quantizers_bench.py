"""benchmarks/bench_quantizers.py end to end at a tiny size with torch.cuda emulated on the CPU
(support/quantizer_bench_on_cpu.py): every candidate config of every quantizer runs, passes its
bit-exactness check and writes a row that follows the schema."""

import json
import os
import subprocess
import sys
from pathlib import Path

from megatron_fp4.kernels import fp8_quantize, fp8_quantize_both, fp8_quantize_cols, fp8_quantize_weight

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # benchmarks/ is a folder of the repository, not of the installed package

from benchmarks import rows  # noqa: E402


def test_the_quantizer_sweep_times_every_candidate_and_writes_rows(tmp_path):
    env = dict(os.environ, MEGATRON_FP4_BENCH_RESULTS=str(tmp_path), MEGATRON_FP4_COMMIT="abc1234",
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]))
    args = ["--sizes", "128x128", "--experts", "4", "--repeats", "1", "--batch", "1", "--warmup", "0"]
    run = subprocess.run([sys.executable, "-m", "support.quantizer_bench_on_cpu", *args], cwd=ROOT / "tests", env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "MISMATCH" not in run.stdout
    written = [json.loads(line) for line in (tmp_path / "bench_quantizers.jsonl").read_text().splitlines()]
    # The fused quantizer's time against the two separate defaults of the same run: one row.
    fused = [row for row in written if row["metric"] == "time"]
    written = [row for row in written if row["metric"] != "time"]
    assert len(fused) == 1 and rows.row_problems(fused[0]) == []
    by_case = {(row["case"], row["default"]): row for row in written if row["default"]}
    separate_ms = (by_case[("quantize_fp8_rows", True)]["ms"] + by_case[("quantize_fp8_cols_ragged", True)]["ms"])
    assert fused[0]["case"] == "quantize_fp8_rows_and_cols_ragged" and fused[0]["better"] == "lower"
    assert fused[0]["reference_value"] == separate_ms
    assert fused[0]["value"] == by_case[("quantize_fp8_rows_and_cols_ragged", True)]["ms"]
    for row in written:
        assert rows.row_problems(row) == [], row
        assert (row["bench"], row["metric"], row["unit"], row["commit"], row["tokens"], row["hidden"]) == (
            "bench_quantizers", "bandwidth", "GB/s", "abc1234", 128, 128)
        assert row["bit_exact"] is True
    expected = {("quantize_fp8_rows", len(fp8_quantize.CONFIGS)), ("quantize_fp8_cols_ragged", len(fp8_quantize_cols.CONFIGS)),
                ("quantize_fp8_rows_and_cols_ragged", len(fp8_quantize_both.CONFIGS)),
                ("quantize_fp8_weight", len(fp8_quantize_weight.CONFIGS)),
                ("quantize_fp8_weight_t", len(fp8_quantize_weight.CONFIGS))}
    assert {(case, sum(r["case"] == case for r in written)) for case, _ in expected} == expected
    assert sum(r["default"] for r in written) == 5
