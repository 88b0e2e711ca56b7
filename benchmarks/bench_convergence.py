"""Convergence on real text: BF16, FP8 and FP4 runs of the convergence proxy (configs/convergence/)
trained side by side on one GPU, then their final whole-validation loss against BF16 of the same seed.
A config whose cluster section names more GPUs (fp4_ep2.yaml: expert parallelism 2) trains on that
many (GPUs 0.., shared with the other runs); its rows say how many (`gpus`).

    python -m benchmarks.bench_convergence                        # the default runs, 2000 iterations
    python -m benchmarks.bench_convergence --iters 20 --runs bf16,fp4 --budget-s 100   # smoke
    python -m benchmarks.bench_convergence --run "bf16_lr2 bf16 1234 --lr 2e-3"        # a run of your own
    python -m benchmarks.bench_convergence --from-logs DIR [--reference-from DIR2]     # rows from logs

Builds the corpus when its prefix is missing (megatron_fp4.corpus: this machine's standard library
and torch sources), refuses runs that would see one epoch or more of its train split, then starts
every run at once, each through scripts/launch.py (torchrun --standalone: each its own free
rendezvous port) with its own run directory, log and dataset index cache, and prints which run is at
which iteration until all end or --budget-s passes (then the rest are stopped and reported as not
finished). From each log (benchmarks/convergence_log.py): the lm loss every --log-interval, Megatron's
final validation over the whole validation split, NaN and skipped iterations, the largest
step-to-step rise of the logged loss, tokens/s (the runs share the GPU: not comparable to a run alone,
and written only where the reference trained on as many GPUs).

Rows (benchmarks/rows.py) go to $MEGATRON_FP4_BENCH_RESULTS (default benchmarks/results/):
convergence.jsonl (bench=convergence: per run the final validation loss with reference = the BF16 run
of the same seed and data order, the largest loss jump, tokens/s, iterations completed; the BF16
repeat and the BF16 run with another init and the same data order are the noise rows) and
convergence_curves.jsonl (bench=convergence_curves: one row per logged iteration per run). Each row
carries the validation set's SHA-256 (printed by the trainer) and whether it equals the reference's.

A SIGTERM or SIGINT while the runs train stops them as the budget does (bounded: SIGTERM, SIGKILL
STOP_GRACE_S later, KILL_WAIT_S more at most), then the summary and the rows are written for what the
logs hold and the harness exits 128 + the signal; a run whose log holds its final validation loss
counts as finished. Under an outer time limit keep --budget-s WRITE_MARGIN_S (30 s) below what the
limit leaves when the runs start, and let the limit signal before it kills (`timeout -k 25 ...`).
At start the harness writes corpus.json (the corpus record the rows need) and harness.json (the rows'
GPU, versions, commit and start time, the iterations, the runs) into the out dir; --from-logs DIR
then writes the summary and rows of DIR's logs without launching (status "re-read from DIR"), and
--reference-from DIR2 takes BF16 references missing among the runs from another invocation's out dir
(same corpus and validation set, else that comparison is refused). --reference-rows RESULTS (with or
without --from-logs) takes the references still missing from stored rows (convergence_rows.py): a
call can then train candidate runs only, against BF16 runs of earlier calls.

Seeds: --seed sets the model's initialization; the data order (the GPTDataset shuffle and the
sample windows, validation included) follows MEGATRON_FP4_DATA_SEED when a run names a data seed
(launch/data_order.py), else --seed. A run spec is "NAME CONFIG SEED [data_seed=N] [FLAGS ...]",
CONFIG a name in configs/convergence/ or a path.
"""

import argparse
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from benchmarks.convergence_log import RunLog, largest_jump, parse_log, tokens_per_second
from benchmarks.convergence_rows import reference_config_of, stored_reference
from benchmarks.rows import Recorder, run_info
from megatron_fp4.console import quiet_third_party_notices

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs" / "convergence"
LAUNCH = REPO / "scripts" / "launch.py"
DEFAULT_CORPUS = REPO / "runs" / "corpus" / "python_sources"
SEEDS = (1234, 5678, 9012, 3456)
LOSS_UNIT = "nats/token"
DEFAULT_ITERS = 2000
STOP_GRACE_S = 10  # after SIGTERM, before SIGKILL (the trainer saves nothing on SIGTERM)
KILL_WAIT_S = 5
TICK_S = 0.2  # how often the harness looks at its runs and for a signal
WRITE_MARGIN_S = 30  # stopping the runs (STOP_GRACE_S + KILL_WAIT_S), parsing the logs, writing the rows
CORPUS_JSON = "corpus.json"  # in the out dir: the corpus record the rows need (--from-logs)
HARNESS_JSON = "harness.json"  # in the out dir: the rows' run info, the iterations and the runs


@dataclass(frozen=True)
class Run:
    name: str
    config: str
    seed: int
    data_seed: Optional[int] = None  # None: the data order follows --seed
    flags: tuple = field(default_factory=tuple)

    @property
    def order(self) -> int:
        """The seed of the data order."""
        return self.seed if self.data_seed is None else self.data_seed

    def config_path(self) -> Path:
        path = Path(self.config)
        return path if path.suffix == ".yaml" else CONFIGS / f"{self.config}.yaml"

    @property
    def config_name(self) -> str:
        """The config as the rows name it: its path under configs/convergence/ ("fp4.yaml",
        "h512/fp4.yaml"), else its file name."""
        path = self.config_path().resolve()
        return str(path.relative_to(CONFIGS)) if path.is_relative_to(CONFIGS) else path.name

    @property
    def reference_config(self) -> str:
        """The BF16 config of this run's proxy: bf16.yaml in the folder of the run's config (the
        larger proxies in configs/convergence/h512/ ... have their own)."""
        return reference_config_of(self.config_name)

    @property
    def is_plain_reference(self) -> bool:
        """A BF16 run of its proxy's BF16 config with no extra flags and the data order of its seed."""
        return self.config_name == self.reference_config and not self.flags and self.data_seed is None


def _catalogue() -> Dict[str, Run]:
    first, second = SEEDS[:2]
    runs = [Run(precision, precision, first) for precision in ("bf16", "fp8", "fp4")]
    # Seeds 2, 3, 4: each seed's runs differ from the first seed's in initialization and data order.
    runs += [Run(f"{precision}_seed{n}", precision, seed)
             for n, seed in enumerate(SEEDS[1:], 2) for precision in ("bf16", "fp8", "fp4")]
    runs += [Run("bf16_repeat", "bf16", first),  # the kernels' nondeterminism
             Run("bf16_init2", "bf16", second, data_seed=first)]  # another init, the same data order
    runs += [Run(name, name, first) for name in ("fp4_dispatch", "fp4_dispatch_experts", "fp4_dispatch_experts_linears")]
    # The FP8 linears by role: attention, or the dense MLP and shared expert, left to BF16.
    runs += [Run(f"{precision}_bf16_{role}", f"{precision}_bf16_{role}", first)
             for precision in ("fp8", "fp4") for role in ("attention", "mlps")]
    # The FP8 linears' backward GEMMs in BF16, at the first two seeds.
    runs += [Run(f"{precision}_bf16_grads{suffix}", f"{precision}_bf16_grads", seed)
             for precision in ("fp8", "fp4") for suffix, seed in (("", first), ("_seed2", second))]
    return {run.name: run for run in runs}


CATALOGUE = _catalogue()
DEFAULT_RUNS = ("bf16", "fp8", "fp4", "bf16_seed2", "fp8_seed2", "fp4_seed2", "bf16_repeat", "bf16_init2",
                "fp4_dispatch", "fp4_dispatch_experts")


def parse_run_spec(text: str) -> Run:
    """"NAME CONFIG SEED [data_seed=N] [FLAGS ...]" -> Run."""
    words = shlex.split(text)
    if len(words) < 3 or not words[2].lstrip("-").isdigit():
        raise ValueError(f"run spec {text!r}: expected 'NAME CONFIG SEED [data_seed=N] [FLAGS ...]'")
    data_seed, flags = None, words[3:]
    if flags and flags[0].startswith("data_seed="):
        data_seed, flags = int(flags[0].split("=", 1)[1]), flags[1:]
    return Run(words[0], words[1], int(words[2]), data_seed, tuple(flags))


def references(runs: List[Run]) -> Dict[str, Run]:
    """Each run's BF16 reference among `runs`: the first plain BF16 run (its proxy's bf16.yaml, no
    extra flags, data order from its seed) of the run's proxy and seed when the run's data order
    follows that seed (a plain BF16 run is thus its own reference), else the first plain BF16 run of
    its proxy whose seed is the run's data seed (the same data order, another init). Runs without
    either are left out."""
    plain = {}
    for run in runs:
        if run.is_plain_reference:
            plain.setdefault((run.reference_config, run.seed), run)
    chosen = {}
    for run in runs:
        reference = plain.get((run.reference_config, run.order))
        if reference is not None:
            chosen[run.name] = reference
    return chosen


def role(run: Run, reference: Run) -> str:
    if run is reference:
        return "reference"
    if run.config_name != run.reference_config or run.flags:
        return "compared"
    return "noise: repeat (same seed, same data)" if run.seed == reference.seed else "noise: init (same data order)"


def command(run: Run, iters: int, corpus: Path, run_dir: Path) -> List[str]:
    return [sys.executable, str(LAUNCH), str(run.config_path()), "--train-iters", str(iters), "--seed", str(run.seed),
            "--data-path", str(corpus), "--data-cache-path", str(run_dir / "index_cache"), *run.flags]


def environment(run: Run, run_dir: Path) -> dict:
    # The config's cluster section decides the GPUs (run_gpus), not a variable left in the caller's shell.
    env = {k: v for k, v in os.environ.items()
           if k not in ("MEGATRON_FP4_DATA_SEED", "RUN_ID", "NNODES", "GPUS_PER_NODE")}
    env["RUN_DIR"] = str(run_dir)
    if run.data_seed is not None:
        env["MEGATRON_FP4_DATA_SEED"] = str(run.data_seed)
    return env


def run_gpus(run: Run) -> int:
    """The GPUs a run trains on, as scripts/launch.py starts it: its config's nodes x GPUs per node."""
    from megatron_fp4.run_config import load_config

    cluster = load_config(run.config_path()).cluster
    return int(cluster.get("nodes", 1)) * int(cluster.get("gpus_per_node", 1))


def config_numbers(run: Run) -> dict:
    """The settings of a run's config that size it (its flags win)."""
    from megatron_fp4.run_config import load_config, planned_args

    args = planned_args(load_config(run.config_path()), list(run.flags))
    return {"global_batch_size": args.global_batch_size, "seq_length": args.seq_length, "split": args.split}


def corpus_record(corpus: Path, runs: List[Run]) -> dict:
    """What the rows and the epoch check need of an existing corpus, as the harness copies it into the
    out dir (corpus.json): its SHA-256, tokens and the train split's tokens under each run's --split."""
    from megatron_fp4.corpus import read_record, split_tokens

    record = read_record(corpus)
    splits = sorted({config_numbers(run)["split"] for run in runs})
    return {"prefix": str(corpus), "sha256": record["sha256"], "tokens": record["tokens"],
            "train_split_tokens": {split: split_tokens(corpus, split)[0] for split in splits}}


def check_less_than_one_epoch(runs: List[Run], iters: int, record: dict) -> dict:
    """Tokens per run against the corpus's train split (record: corpus_record's); raises SystemExit for
    one epoch or more."""
    sizes = {}
    for run in runs:
        numbers = config_numbers(run)
        train = record["train_split_tokens"].get(numbers["split"])
        if train is None:
            raise SystemExit(f"error: the corpus record has no train split size for run {run.name}'s split "
                             f"{numbers['split']}; give --corpus, the corpus the run trained on.")
        tokens = iters * numbers["global_batch_size"] * numbers["seq_length"]
        if tokens >= train:
            raise SystemExit(f"error: run {run.name} would train on {tokens} tokens, {tokens / train:.2f} epochs of "
                             f"the corpus's {train}-token train split; lower --iters or build a larger corpus.")
        sizes[run.name] = {"tokens_per_iteration": numbers["global_batch_size"] * numbers["seq_length"],
                           "tokens_per_run": tokens, "train_split_tokens": train}
    return {"corpus_sha256": record["sha256"], "corpus_tokens": record["tokens"], "sizes": sizes}


class Signals:
    """SIGTERM and SIGINT while the runs train and the rows are written: the first is remembered (the
    harness then stops the runs and writes what their logs hold), later ones are ignored so that the
    rows still get written. Only SIGKILL (an outer `timeout -k`) cuts that short."""

    NAMES = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT"}

    def __init__(self):
        self.received: Optional[int] = None
        self._previous = {}

    def __enter__(self):
        for sig in self.NAMES:
            self._previous[sig] = signal.signal(sig, self._remember)
        return self

    def _remember(self, signum, frame):
        if self.received is None:
            self.received = signum

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @property
    def name(self) -> str:
        return self.NAMES.get(self.received, str(self.received))


def _wait_all(processes: List[subprocess.Popen], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
        time.sleep(TICK_S)


def stop_all(processes: Dict[str, subprocess.Popen]) -> List[str]:
    """SIGTERM to every run's process group (launch.py, torchrun, the trainer), SIGKILL to every group
    after STOP_GRACE_S (also what outlived its launcher), then at most KILL_WAIT_S more: bounded by
    STOP_GRACE_S + KILL_WAIT_S in all, however many runs. Returns the runs whose launcher had still not
    exited."""
    for sig, seconds in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, KILL_WAIT_S)):
        for process in processes.values():
            try:
                os.killpg(process.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass  # the group has ended
        _wait_all(list(processes.values()), seconds)
    return [name for name, process in processes.items() if process.poll() is None]


def read_log(run_dir: Path) -> RunLog:
    log = run_dir / "train_node0.log"
    return parse_log(log.read_text(errors="replace")) if log.exists() else RunLog()


def progress_line(elapsed: float, runs: List[Run], logs: Dict[str, RunLog], iters: int, status: Dict[str, str]) -> str:
    parts = []
    for run in runs:
        log = logs[run.name]
        if run.name in status:
            parts.append(f"{run.name} {status[run.name]}")
        elif log.evaluated[1]:
            parts.append(f"{run.name} validating {log.evaluated[0]}/{log.evaluated[1]}")
        else:
            parts.append(f"{run.name} {log.last_iteration}/{iters}")
    return f"[{elapsed:5.0f} s] " + " | ".join(parts)


def stopped_status(process: subprocess.Popen, log: RunLog, why: str, stuck: bool) -> str:
    """The status of a run that was still going when it was stopped (`why`): a run whose log holds its
    final validation loss had finished training and evaluating and was stopped while exiting."""
    if process.returncode == 0:
        return "finished"
    if log.final_validation_loss is not None:
        return f"finished (final validation logged; {why} while exiting)"
    return why + (" (its launcher outlived SIGKILL)" if stuck else "")


def run_all(runs: List[Run], iters: int, corpus: Path, out_dir: Path, budget_s: float, poll_s: float,
            signals: Optional[Signals] = None) -> Dict[str, str]:
    """Start every run, report progress, stop what is left at the budget or at the first SIGTERM/SIGINT
    (`signals`); returns each run's status. Whatever ends this, no run is left going."""
    signals = signals or Signals()
    processes, status = {}, {}
    try:
        for run in runs:
            if signals.received is not None:
                status[run.name] = f"not started ({signals.name})"
                continue
            run_dir = out_dir / run.name
            run_dir.mkdir(parents=True, exist_ok=True)
            argv = command(run, iters, corpus, run_dir)
            (run_dir / "harness_command.txt").write_text(shlex.join(argv) + "\n")
            with open(run_dir / "launch.out", "wb") as out:
                processes[run.name] = subprocess.Popen(argv, env=environment(run, run_dir), cwd=REPO, stdout=out,
                                                       stderr=subprocess.STDOUT, start_new_session=True)
            print(f"started {run.name}: {run.config_name}, seed {run.seed}, data order {run.order}, {run_dir}",
                  flush=True)
        start = time.monotonic()
        next_report = start + poll_s
        while True:
            for name, process in processes.items():
                if name not in status and process.poll() is not None:
                    status[name] = "finished" if process.returncode == 0 else f"failed (exit {process.returncode})"
            elapsed = time.monotonic() - start
            going = {name: process for name, process in processes.items() if name not in status}
            if going and (signals.received is not None or elapsed > budget_s):
                why = f"stopped by {signals.name}" if signals.received is not None else f"stopped at the {budget_s:g} s budget"
                print(f"{why}: stopping {', '.join(going)}", flush=True)
                stuck = stop_all(going)
                for name, process in going.items():
                    status[name] = stopped_status(process, read_log(out_dir / name), why, name in stuck)
            if len(status) == len(runs) or time.monotonic() >= next_report:
                logs = {run.name: read_log(out_dir / run.name) for run in runs}
                print(progress_line(elapsed, runs, logs, iters, status), flush=True)
                next_report = time.monotonic() + poll_s
            if len(status) == len(runs):
                return status
            time.sleep(TICK_S)
    finally:
        left = {name: process for name, process in processes.items() if process.poll() is None}
        if left:  # an error in the harness itself: the runs live in sessions of their own
            stop_all(left)


@dataclass
class Reference:
    """A run's BF16 reference: a run of the same invocation, or of another one (`source`, the run
    directory of --reference-from, or `rows_of`, which stored rows of --reference-rows)."""
    run: Run
    log: RunLog
    source: Optional[Path] = None
    rows_of: Optional[str] = None

    @property
    def other_invocation(self) -> bool:
        return self.source is not None or self.rows_of is not None

    @property
    def label(self) -> str:
        return f"BF16 {self.run.name}" + (" (another invocation)" if self.other_invocation else "")


def resolve_references(runs: List[Run], logs: Dict[str, RunLog], reference_dir: Optional[Path] = None,
                       corpus_sha256: Optional[str] = None, reference_rows: Optional[Path] = None,
                       iters: Optional[int] = None) -> Dict[str, Reference]:
    """Each run's reference among `runs` (references()); for a run without one, the plain BF16 run of
    its data order in `reference_dir` (another invocation), when its validation set has the same
    SHA-256 (and its corpus, where that directory's corpus.json says, the same SHA-256); failing that,
    the latest such run of `iters` iterations among the stored rows in the folder `reference_rows`."""
    chosen = {name: Reference(run, logs[run.name]) for name, run in references(runs).items()}
    if reference_dir is not None:
        chosen.update(_references_from_logs(runs, logs, chosen, reference_dir, corpus_sha256))
    if reference_rows is not None and corpus_sha256 is not None and iters is not None:
        for run in runs:
            if run.name in chosen:
                continue
            stored = stored_reference(reference_rows, run.reference_config, run.order, iters,
                                      logs[run.name].validation_sha256, corpus_sha256)
            if stored is None:
                print(f"{run.name}: no plain BF16 run ({run.reference_config}) of data order {run.order} and {iters} "
                      f"iterations on its validation set in the rows of {reference_rows} either: no comparison rows")
                continue
            reference_config = str(Path(run.reference_config).with_suffix(""))
            chosen[run.name] = Reference(Run(stored.name, reference_config, run.order), stored.log,
                                         rows_of=stored.origin)
    return chosen


def _references_from_logs(runs: List[Run], logs: Dict[str, RunLog], chosen: Dict[str, Reference], reference_dir: Path,
                          corpus_sha256: Optional[str]) -> Dict[str, Reference]:
    """resolve_references' references from another invocation's out dir, for the runs not in `chosen`."""
    found_refs = {}
    candidates = [run for run in invocation_runs(reference_dir) if run.is_plain_reference]
    other_corpus = read_json(reference_dir / CORPUS_JSON)
    for run in runs:
        if run.name in chosen:
            continue
        found = references(candidates + [run]).get(run.name)
        if found is None:
            print(f"{run.name}: no plain BF16 run ({run.reference_config}) of data order {run.order} in {reference_dir} "
                  "either: no comparison rows")
            continue
        ref_log = read_log(reference_dir / found.name)
        where = f"BF16 {found.name} of {reference_dir}"
        if other_corpus and corpus_sha256 and other_corpus["sha256"] != corpus_sha256:
            print(f"{run.name}: no comparison with {where}: it trained on another corpus "
                  f"(sha256 {other_corpus['sha256'][:16]}, not {corpus_sha256[:16]}).")
        elif ref_log.validation_sha256 is None or ref_log.validation_sha256 != logs[run.name].validation_sha256:
            print(f"{run.name}: no comparison with {where}: its validation set (sha256 "
                  f"{(ref_log.validation_sha256 or 'not logged')[:16]}) is not this run's "
                  f"({(logs[run.name].validation_sha256 or 'not logged')[:16]}).")
        else:
            found_refs[run.name] = Reference(found, ref_log, reference_dir)
    return found_refs


def write_rows(runs: List[Run], logs: Dict[str, RunLog], status: Dict[str, str], iters: int, corpus_info: dict,
               info: Optional[dict] = None, refs: Optional[Dict[str, Reference]] = None,
               concurrent_runs: Optional[int] = None) -> None:
    """The rows of `runs` (info: the rows' run_info, default this machine's now; refs: default the
    references among `runs`)."""
    refs = resolve_references(runs, logs) if refs is None else refs
    shared = {"iters": iters, "corpus_sha256": corpus_info["corpus_sha256"], "corpus_tokens": corpus_info["corpus_tokens"],
              "concurrent_runs": concurrent_runs or len(runs)}
    results, curves = Recorder("convergence", gpus=1, **shared), Recorder("convergence_curves", gpus=1, **shared)
    if info is not None:
        results.info = dict(info)
    curves.info = results.info  # one `run` time for both files (plot_convergence.py pairs them by it)
    print(results.description())
    for run in runs:
        log, reference = logs[run.name], refs.get(run.name)
        sizes = corpus_info["sizes"][run.name]
        about = {"config": run.config_name, "seed": run.seed, "data_seed": log.data_seed, "status": status[run.name],
                 "validation_samples": log.validation_samples, "validation_sha256": log.validation_sha256,
                 "nan_iterations": log.nan_iterations, "skipped_iterations": log.skipped_iterations,
                 "flags": list(run.flags), "gpus": run_gpus(run), **sizes}
        results.add(run.name, "iterations completed", log.last_iteration, "iterations", "iterations asked", iters,
                    better="closer_to_1", **about)
        if reference is None:
            print(f"{run.name}: no BF16 run of the same data order among the runs: no comparison rows")
            continue
        ref_log, label = reference.log, reference.label
        about.update(role=role(run, reference.run), reference_run=reference.run.name,
                     same_validation_set=log.validation_sha256 is not None
                     and log.validation_sha256 == ref_log.validation_sha256)
        if reference.source is not None:
            about["reference_dir"] = str(reference.source)
        if reference.rows_of is not None:
            about["reference_rows"] = reference.rows_of
        if log.final_validation_loss is not None and ref_log.final_validation_loss is not None:
            results.add(run.name, "final validation loss (whole split)", log.final_validation_loss, LOSS_UNIT,
                        label, ref_log.final_validation_loss, better="closer_to_1", **about)
        jump, at = largest_jump(log.points)
        ref_jump, _ = largest_jump(ref_log.points)
        if jump > 0 and ref_jump > 0:
            results.add(run.name, "largest step-to-step loss rise", jump, LOSS_UNIT, label, ref_jump,
                        better="lower", at_iteration=at, **about)
        rate, ref_rate = (tokens_per_second(l.points, sizes["tokens_per_iteration"]) for l in (log, ref_log))
        # Comparable only on the same GPUs, shared by the same runs (not another invocation's).
        if rate and ref_rate and not reference.other_invocation and about["gpus"] == run_gpus(reference.run):
            results.add(run.name, "tokens per second (GPU shared by all runs)", rate, "tokens/s",
                        label, ref_rate, better="higher", **about)
        ref_losses = {p.iteration: p.lm_loss for p in ref_log.points}
        for point in log.points:
            if math.isfinite(point.lm_loss) and math.isfinite(ref_losses.get(point.iteration, math.nan)):
                curves.add(run.name, "lm loss", point.lm_loss, LOSS_UNIT, label, ref_losses[point.iteration],
                           better="closer_to_1", iteration=point.iteration, role=about["role"],
                           reference_run=reference.run.name, seed=run.seed, gpus=about["gpus"])
    results.write()
    curves.write()


def summary(runs: List[Run], logs: Dict[str, RunLog], status: Dict[str, str],
            refs: Optional[Dict[str, Reference]] = None) -> None:
    refs = resolve_references(runs, logs) if refs is None else refs
    width = max([30] + [len(s) for s in status.values()])
    print(f"{'run':<30} {'status':<{width}} {'iters':>6} {'val loss':>9} {'vs BF16':>8} {'nan':>4} {'jump':>7}  validation set")
    for run in runs:
        log, reference = logs[run.name], refs.get(run.name)
        ref_loss = reference.log.final_validation_loss if reference else None
        vs = (f"{(log.final_validation_loss / ref_loss - 1) * 100:+.2f}%"
              if log.final_validation_loss is not None and ref_loss else "-")
        loss = f"{log.final_validation_loss:.4f}" if log.final_validation_loss is not None else "-"
        print(f"{run.name:<30} {status[run.name]:<{width}} {log.last_iteration:>6} {loss:>9} {vs:>8} "
              f"{log.nan_iterations:>4} {largest_jump(log.points)[0]:>7.4f}  {(log.validation_sha256 or '-')[:16]}")


def spec(run: Run) -> str:
    """The run as parse_run_spec reads it."""
    data_seed = [f"data_seed={run.data_seed}"] if run.data_seed is not None else []
    return shlex.join([run.name, run.config, str(run.seed), *data_seed, *run.flags])


def read_json(path: Path) -> Optional[dict]:
    return json.loads(path.read_text()) if path.exists() else None


def invocation_runs(run_dir: Path) -> List[Run]:
    """The runs of the invocation that wrote `run_dir`: those its harness.json names, else the
    catalogue's runs that have a log there."""
    recorded = read_json(run_dir / HARNESS_JSON)
    if recorded is not None:
        return [parse_run_spec(text) for text in recorded["runs"]]
    return [run for name, run in CATALOGUE.items() if (run_dir / name / "train_node0.log").exists()]


def report(runs: List[Run], out_dir: Path, status: Dict[str, str], iters: int, corpus_info: dict, info: dict,
           reference_dir: Optional[Path] = None, concurrent_runs: Optional[int] = None,
           reference_rows: Optional[Path] = None) -> Dict[str, RunLog]:
    """Parse every run's log, print the summary, write the rows."""
    logs = {run.name: read_log(out_dir / run.name) for run in runs}
    refs = resolve_references(runs, logs, reference_dir, corpus_info["corpus_sha256"], reference_rows, iters)
    summary(runs, logs, status, refs)
    write_rows(runs, logs, status, iters, corpus_info, info, refs, concurrent_runs)
    return logs


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_convergence", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", default=None,
                   help=f"comma-separated run names from: {', '.join(CATALOGUE)} (default, when no --run is given "
                        f"either: {','.join(DEFAULT_RUNS)}; with --from-logs, the runs of DIR's harness.json)")
    p.add_argument("--run", action="append", default=[], metavar="SPEC", type=parse_run_spec,
                   help="a run of your own: 'NAME CONFIG SEED [data_seed=N] [FLAGS ...]' (repeatable; with --runs, "
                        "in addition to those; alone, the only runs)")
    p.add_argument("--iters", type=int, default=None,
                   help=f"training iterations per run (default {DEFAULT_ITERS}; with --from-logs, DIR's harness.json's, "
                        "else the logs')")
    p.add_argument("--corpus", type=Path, default=None,
                   help=f"corpus prefix; built from this machine's Python sources when missing (default {DEFAULT_CORPUS}); "
                        "with --from-logs, the corpus the logs trained on (default: DIR/corpus.json)")
    p.add_argument("--out-dir", type=Path, default=None, help="run directories (default runs/convergence_<time>)")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="wall-clock seconds for the runs, after which the rest are stopped (default %(default)s); "
                        f"under an outer time limit, keep it {WRITE_MARGIN_S} s below what is left of that limit "
                        "when the runs start: stopping them and writing the rows takes up to that")
    p.add_argument("--poll-s", type=float, default=10.0, help="seconds between progress lines (default %(default)s)")
    p.add_argument("--plot", type=Path, default=None, help="also write the plot (benchmarks/plot_convergence.py) here")
    p.add_argument("--dry-run", action="store_true", help="check the runs and print their commands, start nothing")
    p.add_argument("--from-logs", type=Path, default=None, metavar="DIR",
                   help="start nothing: write the summary and rows from DIR/<run>/train_node0.log (an --out-dir)")
    p.add_argument("--reference-from", type=Path, default=None, metavar="DIR",
                   help="with --from-logs: BF16 references missing among the runs come from this --out-dir of another "
                        "invocation on the same corpus and validation set")
    p.add_argument("--reference-rows", type=Path, default=None, metavar="DIR",
                   help="BF16 references still missing come from the stored rows in this folder (e.g. "
                        "benchmarks/results): the latest plain BF16 run of the same data order, iterations, "
                        "validation set and corpus; so a call can train candidate runs only")
    p.add_argument("--gpu", default=None,
                   help="with --from-logs, when DIR has no harness.json: the GPU the logs were trained on")
    args = p.parse_args(argv)
    if args.from_logs is None and (args.reference_from or args.gpu):
        p.error("--reference-from and --gpu go with --from-logs")
    if args.from_logs is not None and args.dry_run:
        p.error("--dry-run starts nothing anyway; --from-logs neither")
    if args.runs is None and args.from_logs is not None and (args.from_logs / HARNESS_JSON).exists():
        args.selected = invocation_runs(args.from_logs) + args.run
    else:
        # --run alone names every run: a call of one's own runs must not start the default set too.
        default = "" if args.run else ",".join(DEFAULT_RUNS)
        names = [n for n in (default if args.runs is None else args.runs).split(",") if n]
        unknown = [n for n in names if n not in CATALOGUE]
        if unknown:
            p.error(f"unknown run(s) {', '.join(unknown)}; known: {', '.join(CATALOGUE)}")
        args.selected = [CATALOGUE[n] for n in names] + args.run
    if not args.selected:
        p.error("no runs: give --runs or --run")
    if len({r.name for r in args.selected}) != len(args.selected):
        p.error("two runs share a name")
    return args


def from_logs(args) -> int:
    """--from-logs DIR: the summary and rows of DIR's logs, as after a real run, launching nothing."""
    log_dir, runs = args.from_logs.resolve(), args.selected
    missing = [run.name for run in runs if not (log_dir / run.name / "train_node0.log").exists()]
    if missing:
        raise SystemExit(f"error: {log_dir} has no log of run(s) {', '.join(missing)} (<run>/train_node0.log); "
                         "name the runs it holds with --runs.")
    recorded, copied = read_json(log_dir / HARNESS_JSON), read_json(log_dir / CORPUS_JSON)
    if args.corpus is not None and Path(f"{args.corpus.resolve()}.idx").exists():
        record = corpus_record(args.corpus.resolve(), runs)
        if copied is not None and copied["sha256"] != record["sha256"]:
            raise SystemExit(f"error: the logs in {log_dir} trained on corpus sha256 {copied['sha256'][:16]} "
                             f"({CORPUS_JSON}), not on {args.corpus} (sha256 {record['sha256'][:16]}).")
    elif copied is not None:
        record = copied
    else:
        raise SystemExit(f"error: no corpus record for the logs in {log_dir}: give --corpus, the prefix of the existing "
                         f"corpus they trained on, or put its record in {log_dir / CORPUS_JSON}.")
    logs = {run.name: read_log(log_dir / run.name) for run in runs}
    totals = {log.total_iterations for log in logs.values() if log.total_iterations}
    iters = args.iters or (recorded or {}).get("iters") or (totals.pop() if len(totals) == 1 else None)
    if iters is None:
        raise SystemExit(f"error: the logs in {log_dir} do not agree on the iterations asked; give --iters.")
    corpus_info = check_less_than_one_epoch(runs, iters, record)
    if recorded is not None:
        info = dict(recorded["info"])
    elif args.gpu:
        info = {"gpu": args.gpu, "gpus": 1, "torch": "unknown", "python": "unknown", "date": time.strftime("%Y-%m-%d", time.gmtime()),
                "run": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    else:
        raise SystemExit(f"error: {log_dir} has no {HARNESS_JSON} to say which GPU trained the runs; give --gpu NAME.")
    commit = os.environ.get("MEGATRON_FP4_COMMIT") or info.get("commit")
    if not commit:
        raise SystemExit(f"error: which commit trained the runs in {log_dir}? Set MEGATRON_FP4_COMMIT.")
    info["commit"] = commit
    status = {run.name: f"re-read from {log_dir}" for run in runs}
    concurrent = len(recorded["runs"]) if recorded is not None else None
    report(runs, log_dir, status, iters, corpus_info, info, args.reference_from and args.reference_from.resolve(),
           concurrent, args.reference_rows)
    return 0


def main(argv=None) -> int:
    quiet_third_party_notices()  # before Megatron is imported
    args = parse_args(argv)
    if args.from_logs is not None:
        code = from_logs(args)
        if args.plot is not None:
            from benchmarks import plot_convergence

            plot_convergence.main(["--out", str(args.plot)])
        return code
    runs, iters = args.selected, args.iters or DEFAULT_ITERS
    corpus = (args.corpus or DEFAULT_CORPUS).resolve()
    if not Path(f"{corpus}.idx").exists():
        from megatron_fp4.corpus import build_corpus

        print(f"building the corpus {corpus} ...", flush=True)
        build_corpus(corpus, overwrite=True)  # no index: what is there is an unfinished build
    record = corpus_record(corpus, runs)
    corpus_info = check_less_than_one_epoch(runs, iters, record)
    for run in runs:
        sizes = corpus_info["sizes"][run.name]
        print(f"{run.name}: {sizes['tokens_per_iteration']} tokens/iteration, {sizes['tokens_per_run']} per run, "
              f"{sizes['tokens_per_run'] / sizes['train_split_tokens']:.2f} epochs of the train split")
    out_dir = (args.out_dir or REPO / "runs" / time.strftime("convergence_%Y%m%d_%H%M%S")).resolve()
    if args.dry_run:
        from megatron_fp4.options import UnsupportedConfiguration
        from megatron_fp4.run_config import ConfigError, load_config, validate_config

        for run in runs:
            try:  # what scripts/launch.py --dry-run checks
                validate_config(load_config(run.config_path()), command(run, iters, corpus, out_dir)[3:])
            except (ConfigError, UnsupportedConfiguration) as err:
                print(f"error: run {run.name}: {err}", file=sys.stderr)
                return 2
            seed = f"MEGATRON_FP4_DATA_SEED={run.data_seed} " if run.data_seed is not None else ""
            print(seed + shlex.join(command(run, iters, corpus, out_dir / run.name)))
        return 0
    info = run_info(gpus=1)  # the rows' GPU, versions, commit and start time, also for --from-logs later
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / CORPUS_JSON).write_text(json.dumps(record, indent=1) + "\n")
    (out_dir / HARNESS_JSON).write_text(json.dumps(
        {"info": info, "iters": iters, "budget_s": args.budget_s, "runs": [spec(run) for run in runs]}, indent=1) + "\n")
    with Signals() as signals:  # from here a SIGTERM or SIGINT still ends with the rows written
        status = run_all(runs, iters, corpus, out_dir, args.budget_s, args.poll_s, signals)
        report(runs, out_dir, status, iters, corpus_info, info, reference_rows=args.reference_rows)
        if args.plot is not None:
            from benchmarks import plot_convergence

            plot_convergence.main(["--out", str(args.plot)])
    if signals.received is not None:
        print(f"{signals.name}: the runs were stopped; the rows hold what their logs held", flush=True)
        return 128 + signals.received
    return 0 if all(s.startswith("finished") for s in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
