#!/usr/bin/env python3
"""Each setting's final-validation deviation from BF16, seed by seed, with the mean over seeds, from
the convergence rows (bench=convergence): the table a setting is judged by when one run per seed is
too noisy to decide a bar (docs/convergence.md).

A row counts when its run finished, it was compared with the BF16 run of its own seed, and it trained
the given number of iterations. Where a seed of a setting has several rows (a repeat, or the same
seed on later code), the latest row stands for the seed; the table says which commit that is and how
many rows the seed has.

    python -m benchmarks.convergence_seeds                          # fp8.yaml and fp4.yaml, 2000 iterations
    python -m benchmarks.convergence_seeds --configs fp4.yaml fp4_bf16_grads.yaml
"""

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Dict, List, NamedTuple

from benchmarks.convergence_rows import FINAL_LOSS


class SeedResult(NamedTuple):
    seed: int
    deviation: float  # the run's final validation loss over its BF16 run's, minus one
    commit: str  # of the row standing for the seed
    rows: int  # rows of this setting and seed


class SettingSummary(NamedTuple):
    config: str
    seeds: List[SeedResult]
    mean: float
    sd: float  # sample standard deviation over seeds (nan with one seed)
    se: float  # standard error of the mean


def _counted(row: dict, iters: int) -> bool:
    return (row.get("bench") == "convergence" and row.get("metric") == FINAL_LOSS and row.get("role") == "compared"
            and row.get("status") == "finished" and row.get("iters") == iters)


def summarize(rows: List[dict], config: str, iters: int) -> SettingSummary:
    """The summary of one setting (a config file name, e.g. "fp4.yaml") over the rows given in the
    order they were written."""
    by_seed: Dict[int, List[dict]] = {}
    for row in rows:
        if _counted(row, iters) and row.get("config") == config and not row.get("flags"):
            by_seed.setdefault(row["seed"], []).append(row)
    if not by_seed:
        raise ValueError(f"no finished {iters}-iteration rows of {config} compared with BF16; check --configs and --iters")
    seeds = [SeedResult(seed, runs[-1]["ratio"] - 1.0, runs[-1]["commit"], len(runs)) for seed, runs in by_seed.items()]
    deviations = [s.deviation for s in seeds]
    sd = statistics.stdev(deviations) if len(deviations) > 1 else math.nan
    return SettingSummary(config, seeds, statistics.fmean(deviations), sd, sd / math.sqrt(len(deviations)))


def table(summaries: List[SettingSummary]) -> str:
    """A markdown table: one line per setting, deviations in percent, spreads in points."""
    lines = ["| setting | seed: deviation from BF16 (commit, rows) | mean | standard deviation | standard error |",
             "| --- | --- | ---: | ---: | ---: |"]
    for s in summaries:
        seeds = ", ".join(f"{r.seed}: {100 * r.deviation:+.2f}% ({r.commit}, {r.rows})" for r in s.seeds)
        lines.append(f"| {s.config} | {seeds} | {100 * s.mean:+.2f}% | {100 * s.sd:.2f} | {100 * s.se:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=Path("benchmarks/results"), help="folder of convergence.jsonl")
    p.add_argument("--configs", nargs="+", default=["fp8.yaml", "fp4.yaml"], help="settings (config file names)")
    p.add_argument("--iters", type=int, default=2000)
    args = p.parse_args(argv)
    path = args.results / "convergence.jsonl"
    if not path.exists():
        raise SystemExit(f"convergence_seeds: {path} does not exist; point --results at the folder of convergence.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    try:
        print(table([summarize(rows, config, args.iters) for config in args.configs]))
    except ValueError as error:
        raise SystemExit(f"convergence_seeds: {error}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
