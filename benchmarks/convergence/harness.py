"""Training the runs side by side: the corpus and the epoch check, one scripts/launch.py per run, the
wall-clock budget, and stopping every run on a SIGTERM or SIGINT.

Each run starts through scripts/launch.py (torchrun --standalone: each its own free rendezvous port)
with its own run directory, log and dataset index cache, all at once, on the GPUs its config's
cluster section names (GPUs 0.., shared with the other runs). The harness prints which run is at
which iteration until all end or the budget passes; then the rest are stopped and reported as not
finished.

A SIGTERM or SIGINT while the runs train stops them as the budget does (bounded: SIGTERM, SIGKILL
STOP_GRACE_S later, KILL_WAIT_S more at most), then the summary and the rows are written for what the
logs hold and the harness exits 128 + the signal; a run whose log holds its final validation loss
counts as finished. Under an outer time limit keep the budget WRITE_MARGIN_S below what the limit
leaves when the runs start, and let the limit signal before it kills (`timeout -k 25 ...`).
"""

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from benchmarks.convergence.log import RunLog, read_log
from benchmarks.convergence.runs import REPO, Run

LAUNCH = REPO / "scripts" / "launch.py"
DEFAULT_CORPUS = REPO / "runs" / "corpus" / "python_sources"
DEFAULT_ITERS = 2000
STOP_GRACE_S = 10  # after SIGTERM, before SIGKILL (the trainer saves nothing on SIGTERM)
KILL_WAIT_S = 5
TICK_S = 0.2  # how often the harness looks at its runs and for a signal
WRITE_MARGIN_S = 30  # stopping the runs (STOP_GRACE_S + KILL_WAIT_S), parsing the logs, writing the rows


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


def dry_run(runs: List[Run], iters: int, corpus: Path, out_dir: Path) -> int:
    """Check each run as scripts/launch.py --dry-run does and print its command; start nothing."""
    from megatron_fp4.options import UnsupportedConfiguration
    from megatron_fp4.run_config import ConfigError, load_config, validate_config

    for run in runs:
        try:
            validate_config(load_config(run.config_path()), command(run, iters, corpus, out_dir)[3:])
        except (ConfigError, UnsupportedConfiguration) as err:
            print(f"error: run {run.name}: {err}", file=sys.stderr)
            return 2
        seed = f"MEGATRON_FP4_DATA_SEED={run.data_seed} " if run.data_seed is not None else ""
        print(seed + shlex.join(command(run, iters, corpus, out_dir / run.name)))
    return 0
