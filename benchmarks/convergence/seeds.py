"""Each setting's final-validation deviation from BF16, seed by seed, with the mean over seeds, from
the convergence rows (bench=convergence): the table a setting is judged by when one run per seed is
too noisy to decide a bar (docs/convergence.md).

A row counts when its run finished, it was compared with the BF16 run of its own seed, and it trained
the given number of iterations. Where a seed of a setting has several rows (a repeat, or the same
seed on later code), the latest row stands for the seed; the table says which commit that is and how
many rows the seed has.

Beside it, from the same run's curve (convergence_curves.jsonl): the training loss's deviation from
the BF16 run's at the same iteration, averaged over the second half of the iterations. Both runs
train on the same batches in the same order, so this average is free of the batches' own noise
(it still moves with the run's trajectory: a BF16 run repeated moves it too).

Megatron's BF16 layer is not deterministic on the GPU, so the BF16 run a row was compared with is
itself one draw (a repeat moved the larger proxy's final loss by 0.46%). The third table compares
the same standing rows with the mean of every finished BF16 run of the seed (the same init, data
order, length and validation set: repeats), and says how many there are and how far apart.

    python -m benchmarks.convergence seeds                          # fp8.yaml and fp4.yaml, 2000 iterations
    python -m benchmarks.convergence seeds --configs fp4.yaml fp4_bf16_grads.yaml
    python -m benchmarks.convergence seeds --configs h512/fp4.yaml "h512/fp4.yaml --moe-fp4-storage experts"

A setting is a config file name, optionally followed by the flags its runs added (`--run "NAME
CONFIG SEED FLAGS..."`): only rows with exactly those flags count for it.
"""

import math
import statistics
import sys
from pathlib import Path
from typing import Dict, List, NamedTuple, Sequence

from benchmarks.convergence.references import FINAL_LOSS, read_rows
from benchmarks.convergence.runs import reference_config_of


class SeedResult(NamedTuple):
    seed: int
    deviation: float  # the run's final validation loss over its BF16 run's, minus one
    commit: str  # of the row standing for the seed
    rows: int  # rows of this setting and seed
    training_deviation: float  # the second half's mean training loss ratio to BF16's, minus one (nan: no curve)
    bf16_repeats: List[float]  # final losses of every BF16 run of this seed (the reference and its repeats)
    repeats_deviation: float  # the final loss over those runs' mean, minus one


class Spread(NamedTuple):
    mean: float
    sd: float  # sample standard deviation over seeds (nan with one seed)
    se: float  # standard error of the mean


class SettingSummary(NamedTuple):
    setting: str  # the config file name, then the runs' flags, if any
    seeds: List[SeedResult]
    final: Spread  # of the final validation deviations
    training: Spread  # of the training deviations (over the seeds that have a curve)
    repeats: Spread  # of the deviations from the mean of BF16's repeats


def _finished(row: dict, iters: int) -> bool:
    """A final validation loss of a run that finished `iters` iterations."""
    return (row.get("bench") == "convergence" and row.get("metric") == FINAL_LOSS and row.get("status") == "finished"
            and row.get("iters") == iters)


def _counted(row: dict, iters: int) -> bool:
    return _finished(row, iters) and row.get("role") == "compared"


def training_deviation(curves: List[dict], row: dict, iters: int) -> float:
    """The mean over iterations past iters / 2 of the training loss ratio to BF16's, minus one, in
    the curve of `row`'s run (same harness run and run name); nan when there is no such curve."""
    ratios = [point["ratio"] for point in curves
              if point.get("run") == row.get("run") and point.get("case") == row.get("case")
              and point.get("role") == "compared" and point["iteration"] > iters // 2]
    return statistics.fmean(ratios) - 1.0 if ratios else math.nan


def bf16_repeats(rows: Sequence[dict], row: dict) -> List[float]:
    """Final validation losses of every finished BF16 run like `row`'s reference: its proxy's BF16
    config without flags, the same init seed and data order, iterations and validation set."""
    def order(r: dict) -> int:
        return r.get("data_seed", r["seed"])
    return [r["value"] for r in rows
            if _finished(r, row.get("iters")) and r.get("config") == reference_config_of(row["config"])
            and not r.get("flags") and r["seed"] == row["seed"] and order(r) == order(row)
            and r.get("validation_sha256") == row.get("validation_sha256")]


def _spread(values: List[float]) -> Spread:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return Spread(math.nan, math.nan, math.nan)
    sd = statistics.stdev(values) if len(values) > 1 else math.nan
    return Spread(statistics.fmean(values), sd, sd / math.sqrt(len(values)))


def summarize(rows: List[dict], setting: str, iters: int, curves: Sequence[dict] = ()) -> SettingSummary:
    """The summary of one setting (a config file name, e.g. "fp4.yaml", then the runs' flags, if any)
    over the rows given in the order they were written, with the training deviations from `curves`
    (convergence_curves rows)."""
    config, *flags = setting.split()
    by_seed: Dict[int, List[dict]] = {}
    for row in rows:
        if _counted(row, iters) and row.get("config") == config and list(row.get("flags") or []) == flags:
            by_seed.setdefault(row["seed"], []).append(row)
    if not by_seed:
        raise ValueError(f"no finished {iters}-iteration rows of {setting} compared with BF16; check --configs and "
                         "--iters")
    curves = list(curves)
    seeds = []
    for seed, runs in by_seed.items():
        standing = runs[-1]
        repeats = bf16_repeats(rows, standing)
        # The row's own reference is among them when it was stored; if not, it still counts once.
        if not any(value == standing["reference_value"] for value in repeats):
            repeats.append(standing["reference_value"])
        seeds.append(SeedResult(seed, standing["ratio"] - 1.0, standing["commit"], len(runs),
                                training_deviation(curves, standing, iters), repeats,
                                standing["value"] / statistics.fmean(repeats) - 1.0))
    return SettingSummary(setting, seeds, _spread([s.deviation for s in seeds]),
                          _spread([s.training_deviation for s in seeds]), _spread([s.repeats_deviation for s in seeds]))


def table(summaries: List[SettingSummary]) -> str:
    """Three markdown tables, one line per setting, deviations in percent, spreads in points: the final
    validation deviations, the training deviations of the same runs, and the final deviations from
    the mean of BF16's repeats (with their count and range)."""
    lines = []
    for title, of_seed, spread_of, detail in (
            ("final validation loss vs BF16 (commit, rows)", lambda r: r.deviation, lambda s: s.final, _standing),
            ("training loss, second half vs BF16 (commit, rows)", lambda r: r.training_deviation,
             lambda s: s.training, _standing),
            ("final validation loss vs the mean of BF16's repeats (BF16 runs, their range)",
             lambda r: r.repeats_deviation, lambda s: s.repeats, _repeats)):
        lines += [f"| setting | seed: {title} | mean | standard deviation | standard error |",
                  "| --- | --- | ---: | ---: | ---: |"]
        for s in summaries:
            seeds = ", ".join(f"{r.seed}: {_percent(of_seed(r))} ({detail(r)})" for r in s.seeds)
            spread = spread_of(s)
            lines.append(f"| {s.setting} | {seeds} | {_percent(spread.mean)} | {_points(spread.sd)} | "
                         f"{_points(spread.se)} |")
        lines.append("")
    return "\n".join(lines[:-1])


def _standing(result: SeedResult) -> str:
    """Which row stands for a seed: its commit, and how many rows the seed has."""
    return f"{result.commit}, {result.rows}"


def _repeats(result: SeedResult) -> str:
    """How many BF16 runs a seed's mean has and how far apart they are, in points of their mean."""
    values = result.bf16_repeats
    return f"{len(values)}, {_points((max(values) - min(values)) / statistics.fmean(values))}"


def _percent(value: float) -> str:
    return "-" if math.isnan(value) else f"{100 * value:+.2f}%"


def _points(value: float) -> str:
    return "-" if math.isnan(value) else f"{100 * value:.2f}"


def print_tables(results: Path, settings: Sequence[str], iters: int) -> int:
    """`seeds`: the tables of `settings` from the rows in the folder `results`."""
    path = results / "convergence.jsonl"
    if not path.exists():
        raise SystemExit(f"error: {path} does not exist; point --results at the folder of convergence.jsonl")
    rows = read_rows(path)
    curves_path = results / "convergence_curves.jsonl"
    if not curves_path.exists():
        print(f"seeds: no {curves_path}: the training deviations are not known ('-')", file=sys.stderr)
    curves = read_rows(curves_path)
    try:
        print(table([summarize(rows, setting, iters, curves) for setting in settings]))
    except ValueError as error:
        raise SystemExit(f"error: {error}")
    return 0
