"""What a training run's log says, for bench_proxy_memory: Megatron's memory reports, its iteration
lines (-> tokens/s after warm-up), and how the run ended (trained, out of memory, refused, failed).

The formats are megatron-core 0.19.2's (megatron/training/):
- utils/common_utils.py report_memory, printed after the first logged iterations and every
  --log-memory-interval:
  `[Rank 0] (after 5 iterations) memory (MB) | allocated: ... | max allocated: ... | reserved: ...
  | max reserved: ...`
- training.py training_log, every --log-interval and after the first iteration:
  ` [date] iteration        5/      30 | consumed samples: ... | elapsed time per iteration (ms): 412.3
  | ... | global batch size:    24 | ...`. The line after the first iteration does not reset
  Megatron's interval timer, so the next line averages over every iteration since the start.
- PyTorch's allocator (c10/cuda/CUDACachingAllocator.cpp), on an allocation past the cap:
  `torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity
  of ... 15.00 GiB allowed; Of the allocated memory 13.20 GiB is allocated by PyTorch, and 312.00 MiB
  is reserved by PyTorch but unallocated. ...`
"""

import re
from dataclasses import dataclass
from typing import List, Optional

MEMORY_REPORT = re.compile(
    r"\[Rank (?P<rank>\d+)\] \(after (?P<iteration>\d+) iterations\) memory \(MB\)"
    r" \| allocated: (?P<allocated>[\d.]+) \| max allocated: (?P<max_allocated>[\d.]+)"
    r" \| reserved: (?P<reserved>[\d.]+) \| max reserved: (?P<max_reserved>[\d.]+)")
ITERATION = re.compile(r" iteration +(?P<iteration>\d+)/ *(?P<total>\d+) \|.*?"
                       r" elapsed time per iteration \(ms\): (?P<ms>[\d.]+) \|.*?"
                       r" global batch size: +(?P<batch>\d+) \|")
SIZE = r"[\d.]+ (?:bytes|KiB|MiB|GiB)"  # PyTorch's format_size
OOM = re.compile(rf"CUDA out of memory\. Tried to allocate (?P<request>{SIZE})")
OOM_ALLOWED = re.compile(rf"(?P<allowed>{SIZE}) allowed;")
OOM_ALLOCATED = re.compile(rf"(?P<allocated>{SIZE}) is allocated by PyTorch, [^;]*?and (?P<unallocated>{SIZE}) "
                           r"is reserved by PyTorch but unallocated")
REFUSAL = re.compile(r"^error: (?P<sentence>.+)$", re.MULTILINE)
UNITS = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}

TRAINED, OUT_OF_MEMORY, REFUSED, FAILED, TIMED_OUT = "trained", "OOM", "refused", "failed", "timed out"
# Stopped by the runner after Megatron's last iteration and its "[after training is done]" line: the
# peaks and tokens/s are complete (a cold Triton cache can push a whole run past --time-limit).
TRAINED_THEN_STOPPED = "trained, stopped at exit"
TRAINING_DONE = re.compile(r"^\[after training is done\]", re.MULTILINE)
TRAINED_OUTCOMES = (TRAINED, TRAINED_THEN_STOPPED)


@dataclass(frozen=True)
class MemoryReport:
    iteration: int
    max_allocated_mib: float
    max_reserved_mib: float


@dataclass(frozen=True)
class IterationLine:
    iteration: int
    ms_per_iteration: float
    global_batch: int
    total: int  # the run's --train-iters


@dataclass(frozen=True)
class OutOfMemory:
    request_mib: float  # the allocation that failed
    allowed_mib: Optional[float]  # the cap, as PyTorch printed it (absent without one)
    reserved_mib: Optional[float]  # what the allocator held at the failure (allocated + cached)

    @property
    def demand_mib(self) -> Optional[float]:
        """What the allocator would have held had the allocation succeeded."""
        return None if self.reserved_mib is None else self.reserved_mib + self.request_mib


def size_mib(text: str) -> float:
    """'1.50 GiB' -> 1536.0 (PyTorch's format_size)."""
    number, unit = text.split()
    return float(number) * UNITS[unit] / 2**20


def memory_reports(log: str, rank: int = 0) -> List[MemoryReport]:
    return [MemoryReport(int(m["iteration"]), float(m["max_allocated"]), float(m["max_reserved"]))
            for m in MEMORY_REPORT.finditer(log) if int(m["rank"]) == rank]


def peak_memory(log: str, rank: int = 0) -> Optional[MemoryReport]:
    """The last report's maxima (they only grow: the run's peak up to that report), or None."""
    reports = memory_reports(log, rank)
    return max(reports, key=lambda r: r.iteration) if reports else None


def iteration_lines(log: str) -> List[IterationLine]:
    return [IterationLine(int(m["iteration"]), float(m["ms"]), int(m["batch"]), int(m["total"]))
            for m in ITERATION.finditer(log)]


def tokens_per_second(lines: List[IterationLine], seq_length: int, gpus: int, warmup: int) -> Optional[float]:
    """Tokens per second per GPU over the logged intervals that start after `warmup` iterations.

    Each line covers the iterations since the previous one, except that the first line of a run
    (after its first iteration) does not restart Megatron's interval: the second line covers the
    first line's iterations again, so the first line itself is left out."""
    tokens = seconds = 0.0
    start = 0  # the last iteration before the interval the next line covers
    for line in lines[1:]:
        iterations = line.iteration - start
        if start >= warmup and iterations > 0:
            tokens += iterations * line.global_batch * seq_length
            seconds += iterations * line.ms_per_iteration / 1000.0
        start = line.iteration
    if seconds == 0:
        return None
    return tokens / seconds / gpus


def out_of_memory(log: str) -> Optional[OutOfMemory]:
    """The first CUDA out-of-memory error in the log, or None."""
    m = OOM.search(log)
    if not m:
        return None
    tail = log[m.end():m.end() + 2000]  # the rest of the same message
    allowed = OOM_ALLOWED.search(tail)
    held = OOM_ALLOCATED.search(tail)
    return OutOfMemory(
        request_mib=size_mib(m["request"]),
        allowed_mib=size_mib(allowed["allowed"]) if allowed else None,
        reserved_mib=size_mib(held["allocated"]) + size_mib(held["unallocated"]) if held else None)


def outcome(log: str, exit_status: Optional[int]) -> str:
    """How the run ended: TRAINED (exit 0), OUT_OF_MEMORY, REFUSED (the launcher's or a rank's one
    sentence, exit 2), TIMED_OUT (exit_status None: the runner stopped it; TRAINED_THEN_STOPPED when
    that was after the last iteration) or FAILED."""
    if exit_status is None:
        lines = iteration_lines(log)
        finished = lines and lines[-1].iteration == lines[-1].total and TRAINING_DONE.search(log)
        return TRAINED_THEN_STOPPED if finished else TIMED_OUT
    if exit_status == 0:
        return TRAINED
    if out_of_memory(log):
        return OUT_OF_MEMORY
    if exit_status == 2 and REFUSAL.search(log):
        return REFUSED
    return FAILED


def last_error(log: str) -> str:
    """The line that says why a run stopped: the refusal, else the last line naming an error."""
    refusals = REFUSAL.findall(log)
    if refusals:
        return refusals[-1].strip()
    for line in reversed(log.splitlines()):
        if "Error" in line or "error" in line:
            return line.strip()[:300]
    return ""
