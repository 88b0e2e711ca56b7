"""The runs of bench_proxy_memory: which configs, capped or not, and running one through
scripts/launch.py with a time limit, its output in a log file and its progress on the terminal."""

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from benchmarks import proxy_log

REPO = Path(__file__).resolve().parents[1]
PROXY = REPO / "configs" / "proxy"
LAUNCH = REPO / "scripts" / "launch.py"
PRECISIONS = ("bf16", "fp8", "fp4")
# The paper's three recompute scopes, heaviest first (configs/proxy/memcap1_<precision>_<scope>.yaml).
SCOPES = ("attn_ln_moe", "attn_ln_mlp", "attn")
LIGHTEST = SCOPES[-1]
UNCAPPED_SUFFIX = ":uncapped"


@dataclass(frozen=True)
class Run:
    config: str  # a configs/proxy/ name without .yaml (memcap1_fp8_attn)
    capped: bool

    @property
    def path(self) -> Path:
        return PROXY / f"{self.config}.yaml"

    @property
    def name(self) -> str:
        return f"{self.config}_{'capped' if self.capped else 'uncapped'}"

    @property
    def precision(self) -> str:
        return self.config.split("_")[1]

    @property
    def scope(self) -> str:
        return self.config.split("_", 2)[2]

    def __str__(self) -> str:
        return self.config + ("" if self.capped else UNCAPPED_SUFFIX)


def parse_run(text: str) -> Run:
    """'memcap1_fp8_attn' (under the config's cap) or 'memcap1_fp8_attn:uncapped' (the whole GPU)."""
    config, capped = (text[:-len(UNCAPPED_SUFFIX)], False) if text.endswith(UNCAPPED_SUFFIX) else (text, True)
    run = Run(config.removesuffix(".yaml"), capped)
    if not run.path.is_file():
        raise ValueError(f"no config {run.path.relative_to(REPO)} for run {text!r}")
    return run


def default_runs(every_capped: bool = False) -> list:
    """Every precision at every scope under the cap (heaviest first), except BF16 and FP8 at the
    lightest scope, which the estimate puts over the cap beyond their middle scope (every_capped
    adds them); then those two on the whole GPU: the lightest scope's peaks and tokens/s."""
    runs = [Run(f"memcap1_{p}_{s}", True) for s in SCOPES for p in PRECISIONS
            if every_capped or s != LIGHTEST or p == "fp4"]
    return runs + [Run(f"memcap1_{p}_{LIGHTEST}", False) for p in ("fp8", "bf16")]


def launch_command(run: Run, train_iters: Optional[int]) -> list:
    command = [sys.executable, str(LAUNCH)]
    if run.capped:
        command.append("--enforce-memory-cap")
    command.append(str(run.path))
    if train_iters is not None:
        command += ["--train-iters", str(train_iters)]
    return command


@dataclass
class RunResult:
    run: Run
    outcome: str  # proxy_log.TRAINED, OUT_OF_MEMORY, ...
    seconds: float
    log_path: Path
    exit_status: Optional[int]  # None: stopped at the time limit


def execute(run: Run, log_path: Path, time_limit_s: float, train_iters: Optional[int] = None,
            progress: Callable[[str], None] = print) -> RunResult:
    """Launch one run, its output into log_path; iteration lines and memory reports are passed on
    to `progress` as they come. Past time_limit_s the run's process group is stopped."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "RUN_DIR": str(log_path.with_suffix(""))}
    start = time.monotonic()
    with open(log_path, "w") as log:
        process = subprocess.Popen(launch_command(run, train_iters), cwd=REPO, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
        status = _follow(process, log, start + time_limit_s, progress)
    return RunResult(run, proxy_log.outcome(log_path.read_text(errors="replace"), status),
                     time.monotonic() - start, log_path, status)


def _follow(process: subprocess.Popen, log, deadline: float, progress) -> Optional[int]:
    """Copy the process's output to `log` until it ends (its exit status) or the deadline passes
    (None, after stopping its process group: torchrun and the training processes)."""
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in process.stdout] + [lines.put(None)],
                              daemon=True)
    reader.start()
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            _stop(process)
            return None
        try:
            line = lines.get(timeout=min(remaining, 5.0))
        except queue.Empty:
            continue
        if line is None:  # end of output: the launcher is done
            try:
                return process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                _stop(process)
                return None
        log.write(line)
        if proxy_log.ITERATION.search(line) or proxy_log.MEMORY_REPORT.search(line) or proxy_log.OOM.search(line):
            progress("    " + _short(line))


def _short(line: str) -> str:
    m = proxy_log.ITERATION.search(line)
    if m:
        return f"iteration {m['iteration']}/{m['total']}: {m['ms']} ms"
    m = proxy_log.MEMORY_REPORT.search(line)
    if m:
        return f"after {m['iteration']} iterations: max allocated {m['max_allocated']} MiB"
    return line.strip()[:160]


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to the run's process group (torchrun and its workers), SIGKILL 10 s later."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass
