"""benchmarks/convergence (`python -m benchmarks.convergence`) end to end and its log parser: the parser
on Megatron's own lines (tests/data/convergence_train_log.txt: lines of a real CPU run of our launcher
with a convergence config, Megatron 0.19.2), the loss jump, `train` with a stand-in torchrun that
prints that log (rows, curves, the plot), its wall-clock budget and its epoch check, `from-logs` and
the references from another out dir or from stored rows. Run specs and the choice of references:
test_convergence_runs.py."""

import contextlib
import io
import json
import math
import os
import re
import shlex
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # benchmarks/ is a folder of the repository, not of the installed package

from benchmarks import rows  # noqa: E402
from benchmarks.convergence import __main__ as cli  # noqa: E402
from benchmarks.convergence import harness, plot, runs as specs  # noqa: E402
from benchmarks.convergence import log as run_log  # noqa: E402
from benchmarks.convergence import references  # noqa: E402

LOG = ROOT / "tests" / "data" / "convergence_train_log.txt"


def _numbers_after(text, label):
    return [float(m) for m in re.findall(re.escape(label) + r"\s+([-+0-9.E]+)", text)]


def test_parser_reads_megatrons_lines():
    text = LOG.read_text()
    run = run_log.parse_log(text)
    iteration_lines = [line for line in text.splitlines() if " iteration " in line and "lm loss:" in line]
    assert len(run.points) == len(iteration_lines) > 1
    assert [p.lm_loss for p in run.points] == _numbers_after(text, "| lm loss:")
    assert [p.ms_per_iteration for p in run.points] == _numbers_after(text, "elapsed time per iteration (ms):")
    assert [p.iteration for p in run.points] == [int(re.search(r"iteration\s+(\d+)/", line).group(1))
                                                   for line in iteration_lines]
    assert [run.final_validation_loss] == _numbers_after(text, "lm loss value:")
    assert run.final_validation_iteration == run.last_iteration == run.total_iterations
    assert run.validation_sha256 == re.search(r"sha256 ([0-9a-f]{64})", text).group(1)
    assert run.validation_samples == int(re.search(r"validation set: (\d+) samples", text).group(1))
    assert run.data_seed == int(re.search(r"data seed (\d+)", text).group(1))
    assert run.nan_iterations == run.skipped_iterations == 0


def test_parser_counts_nan_and_skipped_iterations():
    text = LOG.read_text()
    last = [line for line in text.splitlines() if "lm loss:" in line][-1]
    changed = last.replace("number of skipped iterations:   0", "number of skipped iterations:   3").replace(
        "number of nan iterations:   0", "number of nan iterations:   2")
    assert changed != last
    run = run_log.parse_log(text.replace(last, changed))
    assert (run.skipped_iterations, run.nan_iterations) == (3, 2)


def test_largest_jump_and_rates():
    points = [run_log.Point(i, loss, ms) for i, loss, ms in
              ((10, 5.0, 900.0), (20, 4.0, 100.0), (30, 4.5, 100.0), (40, math.nan, 100.0), (50, 3.0, 300.0))]
    assert run_log.largest_jump(points) == (0.5, 30)  # NaN steps are no jump
    assert run_log.largest_jump(points[:2]) == (0.0, 0)
    # The first interval (start-up) is left out: mean of 100, 100, 100, 300 ms.
    assert run_log.tokens_per_second(points, 1000) == pytest.approx(1000 / 0.15)
    assert run_log.deviation(3.03, 3.0) == pytest.approx(0.01)


def _small_corpus(root):
    from megatron_fp4.corpus import build_corpus

    tree = root / "tree"
    tree.mkdir()
    for i in range(40):
        (tree / f"m{i}.py").write_text("".join(f"def f{j}(x):\n    return x * {i} + {j}\n" for j in range(60)))
    return build_corpus(root / "corpus" / "text", [tree], progress=lambda _: None)


@pytest.fixture
def small_corpus(tmp_path):
    return _small_corpus(tmp_path)


def _stand_ins(monkeypatch, torchrun_code, results):
    """A harness call's environment: a "torchrun" that runs torchrun_code, the rows written to results."""
    monkeypatch.setenv("TORCHRUN", shlex.join([sys.executable, "-c", torchrun_code]))
    monkeypatch.setenv("MEGATRON_FP4_BENCH_RESULTS", str(results))
    monkeypatch.setenv("MEGATRON_FP4_COMMIT", "abc1234")


def _harness(tmp_path, monkeypatch, torchrun_code, *argv):
    _stand_ins(monkeypatch, torchrun_code, tmp_path / "results")
    return cli.main(["train", "--corpus", str(tmp_path / "corpus" / "text"), "--out-dir", str(tmp_path / "runs"),
                         "--poll-s", "0.5", *argv])


# Each run's "torchrun" prints the canned log; the launcher tees it into the run's log.
PRINT_THE_LOG = f"print(open({str(LOG)!r}).read())"


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One harness call whose three runs finish (bf16, its repeat and another init, with the plot),
    shared by the tests of a normal finish, which copy what they change: each run's launcher
    imports torch and Megatron (~8 s of CPU), most of these tests' time."""
    root = tmp_path_factory.mktemp("finished")
    corpus = _small_corpus(root)
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as monkeypatch, contextlib.redirect_stdout(out):
        status = _harness(root, monkeypatch, PRINT_THE_LOG, "--runs", "bf16,bf16_repeat,bf16_init2", "--iters", "6",
                          "--plot", str(root / "plot.png"))
    return SimpleNamespace(root=root, corpus=corpus, status=status, out=out.getvalue())


def test_the_harness_end_to_end(finished):
    out, root = finished.out, finished.root
    assert finished.status == 0, out[-3000:]
    assert re.search(r"\] bf16 finished \| bf16_repeat finished \| bf16_init2 finished", out)
    canned = run_log.parse_log(LOG.read_text())
    results = [json.loads(line) for line in (root / "results" / "convergence.jsonl").read_text().splitlines()]
    curves = [json.loads(line) for line in (root / "results" / "convergence_curves.jsonl").read_text().splitlines()]
    for row in results + curves:
        assert rows.row_problems(row) == [], row
        assert row["commit"] == "abc1234" and row["corpus_sha256"] == finished.corpus["sha256"]
    finals = {r["case"]: r for r in results if r["metric"] == "final validation loss (whole split)"}
    assert set(finals) == {"bf16", "bf16_repeat", "bf16_init2"}
    assert finals["bf16_init2"]["reference_run"] == "bf16" and finals["bf16_init2"]["role"].startswith("noise: init")
    assert finals["bf16_repeat"]["reference_run"] == "bf16" and finals["bf16_repeat"]["role"].startswith("noise: repeat")
    assert all(r["value"] == canned.final_validation_loss and r["same_validation_set"] for r in finals.values())
    assert all(r["validation_sha256"] == canned.validation_sha256 for r in finals.values())
    done = {r["case"]: r["value"] for r in results if r["metric"] == "iterations completed"}
    assert done == {name: canned.last_iteration for name in finals}
    assert len(curves) == 3 * len(canned.points) and len({r["run"] for r in results + curves}) == 1
    assert (root / "runs" / "bf16_init2" / "train_node0.log").exists()
    png = root / "plot.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_budget_stops_what_is_left(tmp_path, monkeypatch, small_corpus, capsys):
    status = _harness(tmp_path, monkeypatch, "import time; print('started', flush=True); time.sleep(120)",
                      "--runs", "bf16", "--iters", "6", "--budget-s", "3")
    out = capsys.readouterr().out
    assert status == 1
    assert "bf16 stopped at the 3 s budget" in out
    results = [json.loads(line) for line in (tmp_path / "results" / "convergence.jsonl").read_text().splitlines()]
    assert [(r["metric"], r["value"], r["status"]) for r in results] == [
        ("iterations completed", 0.0, "stopped at the 3 s budget")]


def test_a_run_of_an_epoch_or_more_is_refused(tmp_path, monkeypatch, small_corpus):
    with pytest.raises(SystemExit, match=r"run bf16 would train on \d+ tokens, [0-9.]+ epochs"):
        _harness(tmp_path, monkeypatch, "pass", "--runs", "bf16", "--iters", "100000", "--dry-run")


def test_the_plot_from_rows(tmp_path):
    info = {"gpu": "cpu", "gpus": 1, "commit": "abc1234", "date": "2026-12-02", "run": "2026-12-02T00:00:00Z"}
    curve_rows = [rows.make_row("convergence_curves", case, "lm loss", loss, "nats/token", "BF16 bf16", ref, info,
                                "closer_to_1", iteration=i)
                  for i, ref in ((10, 5.0), (20, 4.0), (30, 3.5)) for case, loss in (("bf16", ref), ("fp4", ref * 1.01))]
    final = rows.make_row("convergence", "fp4", references.FINAL_LOSS, 3.03, "nats/token", "BF16 bf16", 3.0,
                          info, "closer_to_1")
    assert plot.final_deviations([final]) == {"fp4": pytest.approx(1.0)}
    older = dict(curve_rows[0], run="2026-12-01T00:00:00Z", case="old")
    assert {r["case"] for r in plot.rows_of_run(curve_rows + [older], None)} == {"bf16", "fp4"}
    (tmp_path / "convergence_curves.jsonl").write_text("".join(json.dumps(r) + "\n" for r in curve_rows + [older]))
    (tmp_path / "convergence.jsonl").write_text(json.dumps(final) + "\n")
    assert cli.main(["plot", "--results", str(tmp_path), "--out", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def _rows(results_dir):
    return [[json.loads(line) for line in (results_dir / f"{bench}.jsonl").read_text().splitlines()]
            for bench in ("convergence", "convergence_curves")]


def _without(rows_, *names):
    return [{k: v for k, v in row.items() if k not in names} for row in rows_]


# The canned log up to its final evaluation (no "validation loss at iteration" line).
UNFINISHED = "".join(LOG.read_text().partition("Evaluating on")[:1])


def test_sigterm_stops_the_runs_and_writes_their_rows(tmp_path, monkeypatch, small_corpus, capsys):
    # bf16 prints its final validation loss and hangs while exiting; bf16_init2 hangs in its evaluation.
    code = (f"import os, time; log = open({str(LOG)!r}).read(); "
            f"print(log if os.environ['RUN_DIR'].endswith('/bf16') else {UNFINISHED!r}, flush=True); time.sleep(120)")
    runs = tmp_path / "runs"

    def terminate_when_logged():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            logs = [runs / name / "train_node0.log" for name in ("bf16", "bf16_init2")]
            if all(log.exists() and "iteration        6/" in log.read_text() for log in logs):
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.2)

    threading.Thread(target=terminate_when_logged, daemon=True).start()
    start = time.monotonic()
    status = _harness(tmp_path, monkeypatch, code, "--runs", "bf16,bf16_init2", "--iters", "6", "--budget-s", "100")
    out = capsys.readouterr().out
    assert status == 128 + signal.SIGTERM, out[-3000:]
    assert time.monotonic() - start < 60  # not the 100 s budget, nor the stand-ins' 120 s
    results, curves = _rows(tmp_path / "results")
    states = {r["case"]: r["status"] for r in results}
    assert states == {"bf16": "finished (final validation logged; stopped by SIGTERM while exiting)",
                      "bf16_init2": "stopped by SIGTERM"}
    finals = [r for r in results if r["metric"] == "final validation loss (whole split)"]
    assert [r["case"] for r in finals] == ["bf16"]
    canned = run_log.parse_log(LOG.read_text())
    assert {r["case"]: r["value"] for r in results if r["metric"] == "iterations completed"} == {
        "bf16": canned.last_iteration, "bf16_init2": canned.last_iteration}
    assert {r["case"] for r in curves} == {"bf16", "bf16_init2"}
    assert json.loads((runs / "corpus.json").read_text())["sha256"] == small_corpus["sha256"]


def test_from_logs_writes_the_rows_of_a_normal_finish(tmp_path, monkeypatch, finished, capsys):
    assert finished.status == 0
    shutil.copytree(finished.root, tmp_path, dirs_exist_ok=True)  # its corpus, runs and rows
    for suffix in (".bin", ".idx", ".json"):  # the corpus is gone: its record comes from the out dir's copy
        Path(f"{tmp_path / 'corpus' / 'text'}{suffix}").unlink()
    monkeypatch.setenv("MEGATRON_FP4_BENCH_RESULTS", str(tmp_path / "reread"))
    runs = tmp_path / "runs"
    assert cli.main(["from-logs", str(runs)]) == 0  # the runs of its harness.json
    out = capsys.readouterr().out
    assert f"re-read from {runs}" in out
    (results, curves), (reread, reread_curves) = _rows(tmp_path / "results"), _rows(tmp_path / "reread")
    assert {r["status"] for r in reread} == {f"re-read from {runs}"} and {r["status"] for r in results} == {"finished"}
    assert _without(reread, "status") == _without(results, "status") and reread_curves == curves and curves
    (runs / "corpus.json").unlink()
    with pytest.raises(SystemExit, match="no corpus record for the logs in .*give --corpus"):
        cli.main(["from-logs", str(runs)])


def _logs_dir(root, names, text):
    for name in names:
        (root / name).mkdir(parents=True)
        (root / name / "train_node0.log").write_text(text)
    return root


@pytest.mark.parametrize("same_validation_set", [True, False])
def test_reference_from_another_invocation(tmp_path, monkeypatch, capsys, same_validation_set):
    text = LOG.read_text()
    canned = run_log.parse_log(text)
    other = text if same_validation_set else text.replace(canned.validation_sha256, "f" * 64)
    ablation = _logs_dir(tmp_path / "call2", ["fp4_dispatch"], text)
    headline = _logs_dir(tmp_path / "call1", ["bf16", "fp8"], other)
    split = harness.config_numbers(specs.CATALOGUE["fp4_dispatch"])["split"]
    record = {"sha256": "ab" * 32, "tokens": 10 ** 6, "train_split_tokens": {split: 10 ** 6}}
    for root in (ablation, headline):
        (root / "corpus.json").write_text(json.dumps(record))
    monkeypatch.setenv("MEGATRON_FP4_BENCH_RESULTS", str(tmp_path / "results"))
    monkeypatch.setenv("MEGATRON_FP4_COMMIT", "abc1234")
    assert cli.main(["from-logs", str(ablation), "--runs", "fp4_dispatch", "--gpu", "NVIDIA H200",
                         "--reference-from", str(headline)]) == 0
    out = capsys.readouterr().out
    results = [json.loads(line) for line in (tmp_path / "results" / "convergence.jsonl").read_text().splitlines()]
    for row in results:
        assert rows.row_problems(row) == [] and row["gpu"] == "NVIDIA H200" and row["iters"] == canned.total_iterations
    finals = [r for r in results if r["metric"] == "final validation loss (whole split)"]
    if same_validation_set:
        assert [(r["case"], r["reference_run"], r["reference_dir"]) for r in finals] == [
            ("fp4_dispatch", "bf16", str(headline))]
        assert finals[0]["reference"] == "BF16 bf16 (another invocation)" and finals[0]["same_validation_set"]
        assert "tokens per second (GPU shared by all runs)" not in {r["metric"] for r in results}
    else:
        assert finals == [] and [r["metric"] for r in results] == ["iterations completed"]
        assert re.search(rf"fp4_dispatch: no comparison with BF16 bf16 of {re.escape(str(headline))}: its validation "
                         rf"set \(sha256 f{{16}}\) is not this run's \({canned.validation_sha256[:16]}\)\.", out)


def test_reference_rows_of_an_earlier_invocation(tmp_path, monkeypatch, finished, capsys):
    """A call that trains only candidate runs gets its comparisons from the stored rows of a BF16
    run of the same data order, validation set and corpus; a run with no such row gets none."""
    assert finished.status == 0
    shutil.copytree(finished.root, tmp_path, dirs_exist_ok=True)  # the earlier call's corpus and rows
    stored = tmp_path / "results"
    (earlier, _), canned = _rows(stored), run_log.parse_log(LOG.read_text())
    bf16_final = next(r for r in earlier if r["case"] == "bf16" and r["metric"] == "final validation loss (whole split)")
    # Both runs print the same canned log: make the stored BF16 loss differ, so that the rows show which is which.
    bf16_final["value"] = bf16_final["reference_value"] = bf16_final["value"] + 0.125
    (stored / "convergence.jsonl").write_text("".join(json.dumps(r) + "\n" for r in earlier))
    _stand_ins(monkeypatch, PRINT_THE_LOG, tmp_path / "later")
    assert cli.main(["train", "--corpus", str(tmp_path / "corpus" / "text"), "--out-dir", str(tmp_path / "runs2"),
                         "--poll-s", "0.5", "--runs", "", "--iters", "6", "--run", "bf16_lr bf16 1234 --lr 2e-3",
                         "--run", "bf16_other_order bf16 1234 data_seed=77 --lr 2e-3",
                         "--reference-rows", str(stored)]) == 0
    out = capsys.readouterr().out
    results, curves = _rows(tmp_path / "later")
    finals = {r["case"]: r for r in results if r["metric"] == "final validation loss (whole split)"}
    assert set(finals) == {"bf16_lr"}
    final = finals["bf16_lr"]
    assert final["reference"] == "BF16 bf16 (another invocation)" and final["reference_run"] == "bf16"
    assert final["reference_rows"] == f"commit {bf16_final['commit']}, run {bf16_final['run']}"
    assert final["reference_value"] == bf16_final["value"] and final["value"] == canned.final_validation_loss
    assert final["same_validation_set"] and rows.row_problems(final) == []
    # The reference's curve (its largest rise, the curve rows) is the BF16 run's logged losses, from its rows.
    reference = references.stored_reference(stored, "bf16.yaml", 1234, 6, canned.validation_sha256, finished.corpus["sha256"])
    assert [(p.iteration, p.lm_loss) for p in reference.log.points] == [(p.iteration, p.lm_loss) for p in canned.points]
    for order, iters, validation in ((1234, 6, "0" * 64), (1234, 2000, canned.validation_sha256),
                                     (5678, 6, canned.validation_sha256)):
        assert references.stored_reference(stored, "bf16.yaml", order, iters, validation, finished.corpus["sha256"]) is None
    # The larger proxy's runs are compared with its own BF16 config only.
    assert references.stored_reference(stored, "h512/bf16.yaml", 1234, 6, canned.validation_sha256,
                                             finished.corpus["sha256"]) is None
    assert "tokens per second (GPU shared by all runs)" not in {r["metric"] for r in results}
    assert {r["case"] for r in curves} == {"bf16_lr"} and len(curves) == len(canned.points)
    assert "bf16_other_order: no BF16 run (bf16.yaml) of data order 77 and 6 iterations on its validation set in the rows" in out


def test_a_run_on_two_gpus_says_so(tmp_path, monkeypatch, small_corpus, capsys):
    """A config whose cluster names two GPUs (as fp4_ep2.yaml's; BF16 here, since the launcher refuses
    the FP4 flags without CUDA): its launcher starts two processes, its rows say gpus 2, and its
    tokens/s are not set against its one-GPU BF16 reference's."""
    configs = tmp_path / "configs"
    configs.mkdir()
    bf16 = ROOT / "configs" / "convergence" / "bf16.yaml"
    (configs / "bf16.yaml").write_text(f"include: {bf16}\n")
    (configs / "bf16_ep2.yaml").write_text(f"include: {bf16}\ncluster: {{gpus_per_node: 2}}\n"
                                           "expert_model_parallel_size: 2\nmicro_batch_size: 16\n"
                                           "eval_global_batch_size: 2\n")  # one sample per GPU (Megatron asserts)
    record_argv = (f"import os, sys; open(os.path.join(os.environ['RUN_DIR'], 'torchrun_argv.txt'), 'w')"
                   f".write(' '.join(sys.argv[1:])); {PRINT_THE_LOG}")
    monkeypatch.setenv("GPUS_PER_NODE", "8")  # left in the caller's shell: the config decides
    status = _harness(tmp_path, monkeypatch, record_argv, "--run", f"ref {configs / 'bf16.yaml'} 1234",
                      "--run", f"ep2 {configs / 'bf16_ep2.yaml'} 1234", "--iters", "6")
    assert status == 0, capsys.readouterr().out[-3000:]
    for name, gpus in (("ref", 1), ("ep2", 2)):
        argv = (tmp_path / "runs" / name / "torchrun_argv.txt").read_text().split()
        assert argv[argv.index("--nproc-per-node") + 1] == str(gpus)
        assert argv[argv.index("--expert-model-parallel-size") + 1] == str(gpus)
    results = [json.loads(line) for line in (tmp_path / "results" / "convergence.jsonl").read_text().splitlines()]
    curves = [json.loads(line) for line in (tmp_path / "results" / "convergence_curves.jsonl").read_text().splitlines()]
    assert {(r["case"], r["gpus"]) for r in results + curves} == {("ref", 1), ("ep2", 2)}
    rates = {r["case"] for r in results if r["metric"].startswith("tokens per second")}
    assert rates == {"ref"}
    final = [r for r in results if r["case"] == "ep2" and r["metric"].startswith("final validation")]
    assert len(final) == 1 and final[0]["reference_run"] == "ref" and final[0]["role"] == "compared"


def _own_configs(root):
    """Two configs of one's own: bf16.yaml, and a stand-in for an FP8 config (BF16 too: the launcher
    refuses the FP8 flags without CUDA)."""
    configs = root / "own"
    configs.mkdir()
    bf16 = ROOT / "configs" / "convergence" / "bf16.yaml"
    (configs / "bf16.yaml").write_text(f"include: {bf16}\n")
    (configs / "fp8.yaml").write_text(f"include: {bf16}\n")
    return configs


def test_runs_of_ones_own_with_the_same_flags_get_their_comparison_and_plot(tmp_path, monkeypatch, small_corpus,
                                                                          capsys):
    """The issue's call, BF16 and a candidate with the same seed and `--split`: every run used to say
    "no BF16 run of the same data order among the runs: no comparison rows", and the plot step then
    stopped the call ("no convergence_curves rows to plot")."""
    configs = _own_configs(tmp_path)
    status = _harness(tmp_path, monkeypatch, PRINT_THE_LOG, "--iters", "6", "--plot", str(tmp_path / "own.png"),
                      "--run", f"bf16 {configs / 'bf16.yaml'} 777 --split 980,20,0",
                      "--run", f"fp8 {configs / 'fp8.yaml'} 777 --split 980,20,0")
    out = capsys.readouterr().out
    assert status == 0, out[-3000:]
    assert "no comparison rows" not in out
    results, curves = _rows(tmp_path / "results")
    finals = {r["case"]: r for r in results if r["metric"] == "final validation loss (whole split)"}
    assert {case: (r["reference_run"], r["role"], r["flags"]) for case, r in finals.items()} == {
        "bf16": ("bf16", "reference", ["--split", "980,20,0"]), "fp8": ("bf16", "compared", ["--split", "980,20,0"])}
    assert {r["case"] for r in curves} == {"bf16", "fp8"}
    assert (tmp_path / "own.png").read_bytes()[:4] == b"\x89PNG" and f"wrote {tmp_path / 'own.png'}" in out


def test_a_run_without_a_reference_is_still_plotted_and_an_empty_call_says_why(tmp_path, monkeypatch, small_corpus,
                                                                               capsys):
    configs = _own_configs(tmp_path)
    status = _harness(tmp_path, monkeypatch, PRINT_THE_LOG, "--iters", "6", "--plot", str(tmp_path / "alone.png"),
                      "--run", f"alone {configs / 'fp8.yaml'} 777")
    out = capsys.readouterr().out
    assert status == 0, out[-3000:]
    assert "alone: no BF16 run of its proxy (bf16.yaml) with data order 777 and no flags: no comparison rows" in out
    assert (tmp_path / "alone.png").read_bytes()[:4] == b"\x89PNG"
    results = [json.loads(line) for line in (tmp_path / "results" / "convergence.jsonl").read_text().splitlines()]
    assert [r["metric"] for r in results] == ["iterations completed"]
    assert not (tmp_path / "results" / "convergence_curves.jsonl").exists()
    # The same out dir re-read with logs that hold no training loss: no plot, and the reason.
    (tmp_path / "runs" / "alone" / "train_node0.log").write_text("")
    assert cli.main(["from-logs", str(tmp_path / "runs"), "--iters", "6", "--plot", str(tmp_path / "none.png")]) == 0
    out = capsys.readouterr().out
    assert f"no plot: no run logged a training loss (their logs: {tmp_path / 'runs'}/<run>/train_node0.log)" in out
    assert not (tmp_path / "none.png").exists()
    # Stored rows without curves: `plot` says where it looked and what to do instead, in one sentence.
    with pytest.raises(SystemExit, match=r"no convergence_curves rows in .*: curves are written for runs compared "
                                         r"with a BF16 run; to plot every run of an out dir from its logs, use"):
        cli.main(["plot", "--results", str(tmp_path / "results"), "--out", str(tmp_path / "rows.png")])
