"""What a convergence run's training log says (megatron-core 0.18-0.19 line formats, as printed by
megatron/training/training.py and our launcher), and the numbers computed from it.

    iteration lines   " [date] iteration   N/  TOTAL | consumed samples: ... | elapsed time per
                      iteration (ms): T | ... | lm loss: L | ... | number of skipped iterations: S |
                      number of nan iterations: K |" (every --log-interval)
    final validation  " validation loss at iteration N on validation set | lm loss value: V | ..."
    our launcher      "> validation set: N samples, sha256 H" (launch/data_order.py, with --full-validation)
                      "> building GPTDataset ... data seed D"
    evaluation        "Evaluating iter K/N" (Megatron's verbose final evaluation)
"""

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Tuple

ITERATION = re.compile(r"\biteration\s+(\d+)/\s*(\d+) \|")
FIELD = re.compile(r"([A-Za-z_][\w ()/.-]*?):\s+([-+0-9.eEnaNif]+)\s*\|")
FINAL_VALIDATION = re.compile(r"validation loss at iteration (\d+) on validation set \| lm loss value: ([-+0-9.eEnaNif]+)")
VALIDATION_SET = re.compile(r"> validation set: (\d+) samples, sha256 ([0-9a-f]{64})")
DATA_SEED = re.compile(r"train, validation and test splits, data seed (-?\d+)")
EVALUATING = re.compile(r"Evaluating iter (\d+)/(\d+)")


@dataclass
class Point:
    iteration: int
    lm_loss: float
    ms_per_iteration: Optional[float] = None
    skipped: int = 0  # Megatron's counts over the log interval
    nan: int = 0


@dataclass
class RunLog:
    points: List[Point] = field(default_factory=list)
    total_iterations: Optional[int] = None
    final_validation_loss: Optional[float] = None
    final_validation_iteration: Optional[int] = None
    validation_samples: Optional[int] = None
    validation_sha256: Optional[str] = None
    data_seed: Optional[int] = None
    evaluated: Tuple[int, int] = (0, 0)  # the final evaluation's progress: (done, of)

    @property
    def last_iteration(self) -> int:
        return self.points[-1].iteration if self.points else 0

    @property
    def skipped_iterations(self) -> int:
        return sum(p.skipped for p in self.points)

    @property
    def nan_iterations(self) -> int:
        return sum(p.nan for p in self.points)


def _number(text: str) -> float:
    return float(text)


def parse_iteration_line(line: str) -> Optional[Point]:
    match = ITERATION.search(line)
    if match is None:
        return None
    fields = {name.strip(): value for name, value in FIELD.findall(line[match.end():])}
    if "lm loss" not in fields:
        return None
    ms = fields.get("elapsed time per iteration (ms)")
    return Point(int(match.group(1)), _number(fields["lm loss"]), None if ms is None else _number(ms),
                 int(float(fields.get("number of skipped iterations", 0))),
                 int(float(fields.get("number of nan iterations", 0))))


def parse_log(text: str) -> RunLog:
    run = RunLog()
    for line in text.splitlines():
        point = parse_iteration_line(line)
        if point is not None:
            run.points.append(point)
            run.total_iterations = int(ITERATION.search(line).group(2))
            continue
        if match := FINAL_VALIDATION.search(line):
            run.final_validation_iteration, run.final_validation_loss = int(match.group(1)), _number(match.group(2))
        elif match := VALIDATION_SET.search(line):
            run.validation_samples, run.validation_sha256 = int(match.group(1)), match.group(2)
        elif match := DATA_SEED.search(line):
            run.data_seed = int(match.group(1))
        elif match := EVALUATING.search(line):
            run.evaluated = (int(match.group(1)), int(match.group(2)))
    return run


def read_log(run_dir: Path, name: str = "train_node0.log") -> RunLog:
    """What the log in a run directory says so far (an empty RunLog before it exists)."""
    log = run_dir / name
    return parse_log(log.read_text(errors="replace")) if log.exists() else RunLog()


def largest_jump(points: List[Point]) -> Tuple[float, int]:
    """The largest rise of the logged lm loss from one logged iteration to the next, and the
    iteration where it ends ((0.0, 0) without a rise). NaN losses are not jumps (counted apart)."""
    best, where = 0.0, 0
    for before, after in zip(points, points[1:]):
        rise = after.lm_loss - before.lm_loss
        if math.isfinite(rise) and rise > best:
            best, where = rise, after.iteration
    return best, where


def tokens_per_second(points: List[Point], tokens_per_iteration: int, skip_first: int = 1) -> Optional[float]:
    """Tokens per second over the logged intervals after the first `skip_first` (start-up)."""
    times = [p.ms_per_iteration for p in points[skip_first:] if p.ms_per_iteration]
    if not times:
        return None
    return tokens_per_iteration / (sum(times) / len(times) / 1000.0)


def deviation(value: float, reference: float) -> float:
    """Relative deviation from the reference: value / reference - 1."""
    return value / reference - 1.0
