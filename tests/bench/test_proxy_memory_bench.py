"""bench_proxy_memory without a GPU: reading Megatron's and PyTorch's messages (canned in their exact
formats), the rows, the runner around a stand-in torchrun, and the launcher's dry run of every
memcap1 config."""

import json
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # benchmarks/ is a folder of the repository, not of the installed package

from benchmarks import bench_proxy_memory, proxy_log, proxy_rows, proxy_runs, rows  # noqa: E402
from benchmarks.proxy_runs import Run  # noqa: E402

MEMCAP1 = sorted((ROOT / "configs" / "proxy").glob("memcap1_*_*.yaml"))


def iteration_line(iteration: int, ms: float, total: int = 30, batch: int = 24) -> str:
    """megatron/training/training.py training_log's line (log_throughput on, a MoE + MTP run)."""
    return (f" [2026-12-02 10:00:00.000000] iteration {iteration:8d}/{total:8d} | consumed samples: "
            f"{iteration * batch:12d} | elapsed time per iteration (ms): {ms:.1f} | throughput per GPU "
            f"(TFLOP/s/GPU): 123.4 | learning rate: 3.000000E-04 | global batch size: {batch:5d} | lm loss: "
            f"1.000000E+01 | load_balancing_loss: 1.000000E+00 | mtp_1 loss: 1.000000E+01 | loss scale: 1.0 | "
            f"grad norm: 1.234 | number of skipped iterations:   0 | number of nan iterations:   0 |")


def memory_line(iteration: int, max_allocated: float, max_reserved: float, rank: int = 0) -> str:
    """megatron/training/utils/common_utils.py report_memory's line."""
    return (f"[Rank {rank}] (after {iteration} iterations) memory (MB) | allocated: 6000.00 | max allocated: "
            f"{max_allocated:.2f} | reserved: 7000.00 | max reserved: {max_reserved:.2f}")


# PyTorch's CUDACachingAllocator message under set_per_process_memory_fraction, as torchrun's worker
# traceback shows it.
OOM_TEXT = (
    "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity "
    "of 139.81 GiB of which 121.53 GiB is free. Including non-PyTorch memory, this process has 18.27 GiB memory "
    "in use. 15.00 GiB allowed; Of the allocated memory 13.20 GiB is allocated by PyTorch, and 312.00 MiB is "
    "reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
    "Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)\n"
    "E1202 10:00:30.000000 123 torch/distributed/elastic/multiprocessing/api.py:900] failed (exitcode: 1)\n")


TRAINING_DONE = "[after training is done] datetime: 2026-12-02 10:00:40.000000 \n"  # training.py's line


def trained_log(ms=(900.0, 500.0, 400.0, 400.0, 400.0, 400.0, 400.0), peak=(9000.0, 11500.0)) -> str:
    lines = [iteration_line(1, ms[0]), memory_line(1, 8000.0, 8500.0)]
    for n, value in enumerate(ms[1:], 1):
        lines.append(iteration_line(5 * n, value))
        lines.append(memory_line(5 * n, *peak) if n > 1 else memory_line(5, 8800.0, 9900.0))
    return "\n".join(lines) + "\n"


def test_memory_reports_and_the_runs_peak():
    log = trained_log() + memory_line(30, 1.0, 2.0, rank=1)  # another rank's report is not rank 0's
    reports = proxy_log.memory_reports(log)
    assert [r.iteration for r in reports] == [1, 5, 10, 15, 20, 25, 30]
    peak = proxy_log.peak_memory(log)
    assert (peak.iteration, peak.max_allocated_mib, peak.max_reserved_mib) == (30, 9000.0, 11500.0)
    assert proxy_log.peak_memory("no report here") is None


def test_tokens_per_second_leaves_out_warmup_and_knows_the_first_line_does_not_reset():
    lines = proxy_log.iteration_lines(trained_log(ms=(900.0, 500.0, 450.0, 400.0, 400.0, 200.0, 200.0)))
    assert [(line.iteration, line.ms_per_iteration, line.global_batch) for line in lines][:3] == [
        (1, 900.0, 24), (5, 500.0, 24), (10, 450.0, 24)]
    # After 10 warm-up iterations: lines 15 .. 30, 5 iterations each, 24 x 1024 tokens per iteration.
    seconds = 5 * (0.4 + 0.4 + 0.2 + 0.2)
    assert proxy_log.tokens_per_second(lines, 1024, 1, warmup=10) == pytest.approx(20 * 24 * 1024 / seconds)
    # Warm-up 0: the line after iteration 5 covers iterations 1-5 (Megatron's interval restarts only
    # then), so the first line's own iteration is not counted twice.
    seconds_all = 5 * 0.5 + 5 * (0.45 + 0.4 + 0.4 + 0.2 + 0.2)
    assert proxy_log.tokens_per_second(lines, 1024, 1, warmup=0) == pytest.approx(30 * 24 * 1024 / seconds_all)
    assert proxy_log.tokens_per_second(lines, 1024, 2, warmup=10) == pytest.approx(
        proxy_log.tokens_per_second(lines, 1024, 1, warmup=10) / 2)
    assert proxy_log.tokens_per_second(lines, 1024, 1, warmup=30) is None


def test_out_of_memory_is_read_from_pytorchs_message():
    oom = proxy_log.out_of_memory("iteration lines ...\n" + OOM_TEXT)
    assert oom.request_mib == 1536.0 and oom.allowed_mib == 15 * 1024.0
    assert oom.reserved_mib == pytest.approx(13.2 * 1024 + 312.0)
    assert oom.demand_mib == pytest.approx(13.2 * 1024 + 312.0 + 1536.0)
    assert proxy_log.size_mib("512 bytes") == 512 / 2**20 and proxy_log.size_mib("2.00 KiB") == 2 / 1024
    assert proxy_log.out_of_memory(trained_log()) is None


@pytest.mark.parametrize("log, status, expected", [
    (trained_log(), 0, proxy_log.TRAINED),
    (trained_log()[:300] + OOM_TEXT, 1, proxy_log.OUT_OF_MEMORY),
    ("error: --moe-fp4-linears fp8 needs Hopper GPUs (compute capability 9.0, found (8, 0)): ...\n", 2,
     proxy_log.REFUSED),
    ("Traceback (most recent call last):\nRuntimeError: NCCL error\n", 1, proxy_log.FAILED),
    (trained_log()[:300], None, proxy_log.TIMED_OUT),
    # Stopped by the runner after the last iteration and Megatron's end-of-training line: complete.
    (trained_log() + TRAINING_DONE, None, proxy_log.TRAINED_THEN_STOPPED),
    (trained_log(), None, proxy_log.TIMED_OUT),  # all iterations, but not the end-of-training line
    (trained_log()[:300] + "\n" + TRAINING_DONE, None, proxy_log.TIMED_OUT),  # the line, but iteration 1 of 30
])
def test_outcome(log, status, expected):
    assert proxy_log.outcome(log, status) == expected


def test_last_error_names_the_refusal_or_the_error_line():
    assert proxy_log.last_error("noise\nerror: use --transformer-impl local.\n") == "use --transformer-impl local."
    assert proxy_log.last_error("Traceback\nRuntimeError: boom\nexit\n") == "RuntimeError: boom"


def test_default_runs_and_run_names():
    runs = proxy_runs.default_runs()
    assert [str(r) for r in runs] == [
        "memcap1_bf16_attn_ln_moe", "memcap1_fp8_attn_ln_moe", "memcap1_fp4_attn_ln_moe",
        "memcap1_bf16_attn_ln_mlp", "memcap1_fp8_attn_ln_mlp", "memcap1_fp4_attn_ln_mlp",
        "memcap1_fp4_attn", "memcap1_fp8_attn:uncapped", "memcap1_bf16_attn:uncapped"]
    assert len(proxy_runs.default_runs(every_capped=True)) == 11
    assert all(r.path.is_file() for r in proxy_runs.default_runs(every_capped=True))
    run = proxy_runs.parse_run("memcap1_fp8_attn_ln_mlp:uncapped")
    assert (run.config, run.capped, run.precision, run.scope) == ("memcap1_fp8_attn_ln_mlp", False, "fp8", "attn_ln_mlp")
    assert "--enforce-memory-cap" not in proxy_runs.launch_command(run, None)
    assert proxy_runs.launch_command(Run("memcap1_fp4_attn", True), 3)[-4:] == [
        "--enforce-memory-cap", str(ROOT / "configs/proxy/memcap1_fp4_attn.yaml"), "--train-iters", "3"]
    with pytest.raises(ValueError, match="no config configs/proxy/memcap1_fp16_attn.yaml"):
        proxy_runs.parse_run("memcap1_fp16_attn")


def _measured(config, outcome, capped=True, allocated=None, tokens=None, estimate=None, oom=None):
    m = proxy_rows.Measured(Run(config, capped), outcome, 20.0, 15.0, estimate=estimate)
    m.max_allocated_mib, m.tokens_per_s, m.oom = allocated, tokens, oom
    m.max_reserved_mib = allocated * 1.04 if allocated else None
    return m


@pytest.fixture
def measured():
    est = lambda gib, fits: proxy_rows.Estimate(gib * 1024, fits)  # noqa: E731
    oom = proxy_log.out_of_memory(OOM_TEXT)
    return [
        _measured("memcap1_bf16_attn_ln_moe", "trained", allocated=11800.0, tokens=50000.0, estimate=est(11.4, True)),
        _measured("memcap1_fp8_attn_ln_moe", "trained", allocated=11700.0, tokens=55000.0, estimate=est(11.3, True)),
        _measured("memcap1_fp4_attn_ln_moe", "trained", allocated=11000.0, tokens=54000.0, estimate=est(10.5, True)),
        _measured("memcap1_bf16_attn_ln_mlp", "OOM", oom=oom, estimate=est(19.3, False)),
        _measured("memcap1_fp8_attn_ln_mlp", "OOM", oom=oom, estimate=est(16.6, False)),
        _measured("memcap1_fp4_attn_ln_mlp", "trained", allocated=12800.0, tokens=62000.0, estimate=est(12.7, True)),
        _measured("memcap1_fp4_attn", "trained", allocated=13100.0, tokens=64000.0, estimate=est(12.9, True)),
        _measured("memcap1_fp8_attn", "trained", capped=False, allocated=17100.0, tokens=60000.0,
                  estimate=est(16.9, False)),
        _measured("memcap1_bf16_attn", "trained", capped=False, allocated=20100.0, tokens=58000.0,
                  estimate=est(19.9, False)),
    ]


def test_memory_rows(measured, monkeypatch):
    monkeypatch.setenv("MEGATRON_FP4_COMMIT", "abc1234")
    recorder = rows.Recorder("proxy_memory", gpus=1)
    proxy_rows.memory_rows(recorder, measured)
    assert all(rows.row_problems(r) == [] for r in recorder.rows)
    by = {(r["case"], r["metric"]): r for r in recorder.rows}
    peak = by["proxy/memcap1_fp4_attn.yaml, under the 15 GiB cap", "max allocated (Megatron's memory report)"]
    assert peak["ratio"] == pytest.approx(13100 / (12.9 * 1024)) and peak["better"] == "closer_to_1"
    assert peak["reference"] == "megatron-fp4 estimate (installed)" and peak["precision"] == "fp4"
    cap = by["proxy/memcap1_fp4_attn.yaml, under the 15 GiB cap", "max reserved (Megatron's memory report)"]
    assert cap["fits"] is True and cap["reference_value"] == 15 * 1024 and cap["ratio"] < 1
    oom = by["proxy/memcap1_fp8_attn_ln_mlp.yaml, under the 15 GiB cap",
             "reserved + the failed allocation (PyTorch's out-of-memory error)"]
    assert oom["fits"] is False and oom["ratio"] > 1 and oom["outcome"] == "OOM" and oom["estimate_fits"] is False
    versus = by["proxy/memcap1_fp4_attn.yaml, under the 15 GiB cap", "max allocated vs FP8 at the same scope"]
    assert versus["reference"] == "FP8: proxy/memcap1_fp8_attn.yaml, uncapped"
    assert versus["ratio"] == pytest.approx(13100 / 17100)
    uncapped = by["proxy/memcap1_fp8_attn.yaml, uncapped", "max allocated (Megatron's memory report)"]
    assert uncapped["capped"] is False
    assert not any(r["case"].startswith("proxy/memcap1_fp8_attn.yaml") and r["metric"].startswith("max reserved")
                   for r in recorder.rows)  # no cap, no row against it
    assert len(recorder.rows) == 7 + 7 + 2  # peaks of trained runs, capped runs against the cap, FP4 vs FP8


def test_throughput_rows(measured, tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_FP4_COMMIT", "abc1234")
    recorder = rows.Recorder("proxy_throughput", gpus=1)
    proxy_rows.throughput_rows(recorder, measured, warmup=10)
    assert all(rows.row_problems(r) == [] for r in recorder.rows)
    same_scope = [r for r in recorder.rows if not r["case"].startswith("best")]
    # Against BF16 at the same scope (none at attn_ln_mlp, where BF16 ran out of memory), and FP4 also
    # against FP8 there (FP8 ran out of memory at attn_ln_mlp; at attn it ran uncapped).
    assert [(r["precision"], r["scope"], r["reference"].split(":")[0]) for r in same_scope] == [
        ("fp8", "attn_ln_moe", "BF16"), ("fp4", "attn_ln_moe", "BF16"), ("fp4", "attn_ln_moe", "FP8"),
        ("fp4", "attn", "BF16"), ("fp4", "attn", "FP8"), ("fp8", "attn", "BF16")]
    fp4_light = same_scope[3]
    assert fp4_light["reference"] == "BF16: proxy/memcap1_bf16_attn.yaml, uncapped"
    assert fp4_light["ratio"] == pytest.approx(64000 / 58000)
    fp4_against_fp8 = same_scope[2]
    assert fp4_against_fp8["reference"] == "FP8: proxy/memcap1_fp8_attn_ln_moe.yaml, under the 15 GiB cap"
    assert fp4_against_fp8["ratio"] == pytest.approx(54000 / 55000)
    best = [r for r in recorder.rows if r["case"].startswith("best")]
    assert [(r["precision"], r["config"]) for r in best] == [
        ("bf16", "configs/proxy/memcap1_bf16_attn_ln_moe.yaml"), ("fp8", "configs/proxy/memcap1_fp8_attn_ln_moe.yaml"),
        ("fp4", "configs/proxy/memcap1_fp4_attn.yaml")]
    assert [r["ratio"] for r in best] == pytest.approx([50000 / 55000, 1.0, 64000 / 55000])
    assert all(r["reference"] == "FP8's best fitting: proxy/memcap1_fp8_attn_ln_moe.yaml, under the 15 GiB cap"
               for r in best)
    recorder.write(tmp_path)
    written = [json.loads(line) for line in (tmp_path / "proxy_throughput.jsonl").read_text().splitlines()]
    assert len(written) == 9 and {r["bench"] for r in written} == {"proxy_throughput"}


def test_summary_table(measured):
    text = proxy_rows.summary(measured)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["config", "cap", "GiB"] and len(lines) == 2 + len(measured) + 1
    assert "OOM (15365 MiB wanted)" in text
    assert lines[-1] == ("best fitting under the cap: BF16 memcap1_bf16_attn_ln_moe 50000 tokens/s, "
                         "FP8 memcap1_fp8_attn_ln_moe 55000 tokens/s, FP4 memcap1_fp4_attn 64000 tokens/s")


def _stand_in_torchrun(body: str) -> str:
    """TORCHRUN for scripts/launch.py: a Python program in place of torchrun and the trainer."""
    return shlex.join([sys.executable, "-c", body])


def test_a_run_through_the_launcher_is_measured(tmp_path, monkeypatch):
    canned = tmp_path / "canned.log"
    canned.write_text(trained_log())
    monkeypatch.setenv("TORCHRUN", _stand_in_torchrun(
        f"import os, sys; assert os.environ['MEGATRON_FP4_GPU_MEMORY_CAP_GIB'] == '15'; "
        f"print(open({str(canned)!r}).read(), end='')"))
    shown = []
    run = Run("memcap1_bf16_attn_ln_moe", True)  # stock BF16: a launch needs no GPU to get to torchrun
    result = proxy_runs.execute(run, tmp_path / "runs" / f"{run.name}.log", 60, progress=shown.append)
    assert (result.outcome, result.exit_status) == ("trained", 0), result.log_path.read_text()[-2000:]
    assert shown[:2] == ["    iteration 1/30: 900.0 ms", "    after 1 iterations: max allocated 8000.00 MiB"]
    m = proxy_rows.measure(result, 15.0, 1024, warmup=10)
    assert (m.max_allocated_mib, m.max_reserved_mib) == (9000.0, 11500.0)
    assert m.tokens_per_s == pytest.approx(24 * 1024 / 0.4)


def test_a_run_stopped_after_its_last_iteration_is_measured(tmp_path):
    log = tmp_path / "run.log"
    log.write_text(trained_log() + TRAINING_DONE)
    result = proxy_runs.RunResult(Run("memcap1_fp4_attn", True), proxy_log.TRAINED_THEN_STOPPED, 105.0, log, None)
    m = proxy_rows.measure(result, 15.0, 1024, warmup=10)
    assert m.trained and (m.max_allocated_mib, m.max_reserved_mib) == (9000.0, 11500.0)
    assert m.tokens_per_s == pytest.approx(24 * 1024 / 0.4)


def test_a_run_past_its_time_limit_is_stopped(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHRUN", _stand_in_torchrun("import time; print('started', flush=True); time.sleep(600)"))
    run = Run("memcap1_bf16_attn", False)
    result = proxy_runs.execute(run, tmp_path / f"{run.name}.log", 10, progress=lambda line: None)
    assert result.outcome == "timed out" and result.exit_status is None and result.seconds < 30


def test_a_run_that_would_outlast_the_budget_is_not_started_and_the_rows_are_written(tmp_path, monkeypatch, capsys):
    canned = tmp_path / "canned.log"
    canned.write_text(trained_log())
    # The stand-in trainer sleeps 2 s: after the first run, less than --time-limit is left of --budget-s.
    monkeypatch.setenv("TORCHRUN", _stand_in_torchrun(
        f"import time; time.sleep(2); print(open({str(canned)!r}).read(), end='')"))
    monkeypatch.setenv("MEGATRON_FP4_BENCH_RESULTS", str(tmp_path / "results"))
    status = bench_proxy_memory.main(["--runs", "memcap1_bf16_attn_ln_moe", "memcap1_bf16_attn_ln_mlp",
                                      "--time-limit", "30", "--budget-s", "31", "--runs-dir", str(tmp_path / "runs")])
    out = capsys.readouterr().out
    assert status == 1, out[-2000:]
    assert "--budget-s 31: not started: memcap1_bf16_attn_ln_mlp" in out
    written = [json.loads(line) for line in (tmp_path / "results" / "proxy_memory.jsonl").read_text().splitlines()]
    assert {row["case"].split(",")[0] for row in written} == {"proxy/memcap1_bf16_attn_ln_moe.yaml"}


def test_rounds_merge_to_the_median_tokens_and_the_largest_peaks():
    first, second, third = (_measured("memcap1_fp4_attn", "trained", allocated=a, tokens=t)
                            for a, t in ((13000.0, 90000.0), (13100.0, 99000.0), (12900.0, 95000.0)))
    merged = proxy_rows.merge_rounds([first, second, third])
    assert merged.tokens_per_s == 95000.0 and merged.tokens_per_s_rounds == (90000.0, 99000.0, 95000.0)
    assert merged.max_allocated_mib == 13100.0 and merged.seconds == 60.0 and merged.trained
    assert proxy_rows.merge_rounds([first]) is first
    oom = _measured("memcap1_fp4_attn", "OOM", oom=proxy_log.out_of_memory(OOM_TEXT))
    assert proxy_rows.merge_rounds([first, oom]) is oom  # a round that did not train says so
    assert proxy_rows._extras(merged)["tokens_per_s_rounds"] == [90000.0, 99000.0, 95000.0]
    assert "tokens_per_s_rounds" not in proxy_rows._extras(first)


def test_rounds_train_the_runs_in_turns_and_an_out_of_memory_run_once(tmp_path, monkeypatch, capsys):
    """--rounds 2, runs executed by a stand-in for proxy_runs.execute (the launcher's own path is
    tested above) that runs out of memory for the attn_ln_mlp config: the other run trains twice, in
    turns (its second log beside the first), the OOM run once, and the rows carry each round's
    tokens/s and their median."""
    executed = []

    def execute(run, log_path, time_limit_s, train_iters=None, progress=print):
        executed.append(log_path.name)
        oom = "attn_ln_mlp" in run.config
        log_path.parent.mkdir(parents=True, exist_ok=True)
        ms = (900.0,) + (400.0 + 100 * len(executed),) * 6  # each launch a different speed
        log_path.write_text(OOM_TEXT if oom else trained_log(ms=ms))
        status = 1 if oom else 0
        return proxy_runs.RunResult(run, proxy_log.outcome(log_path.read_text(), status), 5.0, log_path, status)

    monkeypatch.setattr(bench_proxy_memory, "execute", execute)
    monkeypatch.setenv("MEGATRON_FP4_BENCH_RESULTS", str(tmp_path / "results"))
    status = bench_proxy_memory.main(["--runs", "memcap1_bf16_attn_ln_moe", "memcap1_bf16_attn_ln_mlp", "--rounds", "2",
                                      "--runs-dir", str(tmp_path / "runs")])
    out = capsys.readouterr().out
    assert status == 0, out[-2000:]
    assert executed == ["memcap1_bf16_attn_ln_moe_capped.log", "memcap1_bf16_attn_ln_mlp_capped.log",
                        "memcap1_bf16_attn_ln_moe_capped_round2.log"]
    assert "[round 2, 1/1] memcap1_bf16_attn_ln_moe" in out
    written = [json.loads(line) for line in (tmp_path / "results" / "proxy_memory.jsonl").read_text().splitlines()]
    trained_rows = [r for r in written if r["outcome"] == "trained"]
    # 24 x 1024 tokens per iteration at 500 ms (first launch) and 700 ms (third); the median of two is their mean.
    each = [24 * 1024 / 0.5, 24 * 1024 / 0.7]
    assert trained_rows and all(r["tokens_per_s_rounds"] == pytest.approx(each, abs=0.1) for r in trained_rows)
    assert f"{each[0]:.0f} / {each[1]:.0f}" in out and f"{sum(each) / 2:.0f}" in out
    assert any(r["outcome"] == "OOM" and "tokens_per_s_rounds" not in r for r in written)
    assert bench_proxy_memory.main(["--runs", "memcap1_fp4_attn", "--rounds", "0"]) == 2


def test_the_runners_dry_run_lists_runs_and_estimates(capsys):
    assert bench_proxy_memory.main(["--dry-run", "--runs", "memcap1_fp4_attn", "memcap1_bf16_attn:uncapped"]) == 0
    out = capsys.readouterr().out
    assert "[1/2] memcap1_fp4_attn (cap 15 GiB; " in out and "[2/2] memcap1_bf16_attn:uncapped (no cap; " in out
    assert "--enforce-memory-cap" in out and "GiB estimated" in out
    assert bench_proxy_memory.main(["--dry-run", "--runs", "memcap1_fp16_attn"]) == 2


@pytest.mark.parametrize("path", MEMCAP1, ids=lambda p: p.name)
def test_every_memcap1_config_passes_the_launchers_dry_run(path, tmp_path, monkeypatch, capsys):
    from megatron_fp4.launch import torchrun  # scripts/launch.py's main, in this process (one Megatron import)

    monkeypatch.setenv("RUN_DIR", str(tmp_path / "run"))
    assert torchrun.main(["--dry-run", "--enforce-memory-cap", str(path)]) == 0
    out = capsys.readouterr().out
    words = shlex.split(out.strip().splitlines()[-1])
    assert words[words.index("--nproc-per-node") + 1] == "1"
    assert words[words.index("--expert-model-parallel-size") + 1] == "1"
    assert "MEGATRON_FP4_GPU_MEMORY_CAP_GIB=15" in out
    assert "--save" not in words and "--load" not in words  # every run starts fresh, writes no checkpoint
    precision, scope = path.stem.split("_", 2)[1:]
    assert ("--moe-fp4-linears" in words and words[words.index("--moe-fp4-linears") + 1] == "fp8") is (
        precision != "bf16")
    assert ("--moe-fp4-dispatch" in words) is (precision == "fp4")
    assert ("--moe-fp4-storage" in words and words[words.index("--moe-fp4-storage") + 1] == "all") is (
        precision == "fp4")
    modules = words[words.index("--recompute-modules") + 1:]
    modules = modules[:next((i for i, w in enumerate(modules) if w.startswith("--")), len(modules))]
    assert modules == {"attn_ln_moe": ["core_attn", "layernorm", "mlp", "moe"],
                       "attn_ln_mlp": ["core_attn", "layernorm", "mlp"], "attn": ["core_attn"],
                       "attn_ln_experts": ["core_attn", "layernorm", "mlp"]}[scope]
    assert ("--moe-fp4-recompute-experts" in words) is (scope == "attn_ln_experts")
