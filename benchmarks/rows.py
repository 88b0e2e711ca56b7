"""Benchmark results as data: every benchmark appends JSON rows to benchmarks/results/<bench>.jsonl.

One row is one measured number next to the reference it is judged against, both measured in the
same run (a ceiling such as the device-to-device copy, or a baseline such as the stock BF16 layer).
The fields are listed in REQUIRED and described in DEVELOPERS.md. One convention for every metric:

    ratio = value / reference_value

so for a rate (GB/s, TFLOP/s) ratio > 1 beats the reference, for a time or a size ratio < 1 does;
`better` says which, per row: "higher", "lower", or "closer_to_1" where the row checks agreement
(a measurement against a prediction).

The device machine gets the working tree without git history: pass MEGATRON_FP4_COMMIT there.
MEGATRON_FP4_BENCH_RESULTS names another results folder (e.g. one that a remote run copies back).
"""

import datetime
import json
import math
import os
import platform
import subprocess
from pathlib import Path
from typing import Dict, List, Optional

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REQUIRED = ("bench", "case", "metric", "value", "unit", "reference", "reference_value", "ratio", "better",
            "gpu", "gpus", "commit", "date")
LOWER_IS_BETTER_UNITS = {"s", "ms", "us", "B", "MiB", "GiB"}
BETTER = ("higher", "lower", "closer_to_1")


def results_dir() -> Path:
    return Path(os.environ.get("MEGATRON_FP4_BENCH_RESULTS", RESULTS_DIR))


def _commit() -> str:
    commit = os.environ.get("MEGATRON_FP4_COMMIT", "")
    if commit:
        return commit
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def run_info(gpus: int) -> Dict[str, object]:
    """What every row of this run shares: GPU, GPU count, commit, date, library versions."""
    import torch

    info: Dict[str, object] = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "gpus": gpus,
        "commit": _commit(),
    }
    now = datetime.datetime.now(datetime.timezone.utc)
    info["date"] = now.strftime("%Y-%m-%d")
    info["run"] = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    info["torch"] = torch.__version__
    info["python"] = platform.python_version()
    for name, module in (("triton", "triton"), ("megatron_core", "megatron.core")):
        try:
            info[name] = __import__(module, fromlist=["__version__"]).__version__
        except ImportError:
            pass
    return info


def run_description(info: Dict[str, object]) -> str:
    """The run's header line for a benchmark's printout."""
    return (f"GPU {info['gpu']} x {info['gpus']}, torch {info['torch']}, Triton {info.get('triton', '-')}, "
            f"megatron-core {info.get('megatron_core', '-')}, Python {info['python']}, commit {info['commit']}")


def make_row(bench: str, case: str, metric: str, value: float, unit: str, reference: str,
             reference_value: float, info: Dict[str, object], better: Optional[str] = None, **extra) -> dict:
    """One row; raises ValueError for a row the schema refuses (e.g. a zero reference)."""
    value, reference_value = float(value), float(reference_value)
    if not (math.isfinite(value) and math.isfinite(reference_value)) or reference_value == 0:
        raise ValueError(f"{bench} {case} {metric}: value {value} and reference_value {reference_value} "
                         "must be finite and the reference nonzero")
    better = better or ("lower" if unit in LOWER_IS_BETTER_UNITS else "higher")
    row = {"bench": bench, "case": case, "metric": metric, "value": value, "unit": unit,
           "reference": reference, "reference_value": reference_value, "ratio": value / reference_value,
           "better": better}
    row.update(info)
    row.update(extra)
    problems = row_problems(row)
    if problems:
        raise ValueError(f"{bench} {case} {metric}: {'; '.join(problems)}")
    return row


def row_problems(row: dict) -> List[str]:
    """What is wrong with a row (empty when it follows the schema)."""
    problems = [f"missing {name}" for name in REQUIRED if name not in row]
    if problems:
        return problems
    for name in ("value", "reference_value", "ratio"):
        if not isinstance(row[name], (int, float)) or not math.isfinite(row[name]):
            problems.append(f"{name} is not a finite number")
    if not problems:
        if row["reference_value"] == 0:
            problems.append("reference_value is 0")
        elif not math.isclose(row["ratio"], row["value"] / row["reference_value"], rel_tol=1e-9, abs_tol=1e-12):
            problems.append(f"ratio {row['ratio']} is not value / reference_value")
    if row["better"] not in BETTER:
        problems.append(f"better is not one of {', '.join(BETTER)}")
    if not isinstance(row["gpus"], int) or row["gpus"] < 1:
        problems.append("gpus is not a positive integer")
    try:
        datetime.date.fromisoformat(str(row["date"]))
    except ValueError:
        problems.append("date is not YYYY-MM-DD")
    for name in ("bench", "case", "metric", "unit", "reference", "gpu", "commit"):
        if not isinstance(row[name], str) or not row[name]:
            problems.append(f"{name} is not a nonempty string")
    return problems


def append_rows(bench: str, rows: List[dict], directory: Optional[Path] = None) -> Path:
    """Append rows to <directory>/<bench>.jsonl, one JSON object per line; returns the file."""
    path = Path(directory or results_dir()) / f"{bench}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for row in rows:
            if row["bench"] != bench:
                raise ValueError(f"row of {row['bench']} written to {bench}.jsonl")
            f.write(json.dumps(row, sort_keys=False) + "\n")
    return path


class Recorder:
    """Collects one run's rows and appends them at the end: `add` per number, then `write`."""

    def __init__(self, bench: str, gpus: int, **shared):
        self.bench = bench
        self.info = run_info(gpus)
        self.shared = shared  # extra fields every row of the run gets (shapes, options)
        self.rows: List[dict] = []

    def description(self) -> str:
        return run_description(self.info)

    def add(self, case: str, metric: str, value: float, unit: str, reference: str, reference_value: float,
            better: Optional[str] = None, **extra) -> dict:
        row = make_row(self.bench, case, metric, value, unit, reference, reference_value, self.info, better,
                       **self.shared, **extra)
        self.rows.append(row)
        return row

    def write(self, directory: Optional[Path] = None) -> Optional[Path]:
        if not self.rows:
            return None
        path = append_rows(self.bench, self.rows, directory)
        print(f"{len(self.rows)} rows appended to {path}")
        return path
