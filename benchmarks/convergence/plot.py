"""The convergence runs as one PNG: the lm loss curves of every run, a zoom on the last quarter of the
iterations, and each run's deviation from its BF16 reference at the same iteration (value /
reference - 1, in %), with the final whole-validation deviations in the legend.

The harness draws it from its runs' logs (`train --plot PNG`, `from-logs DIR --plot PNG`): every run
that logged a training loss, a deviation for those with a reference. `plot` draws it from stored
rows: convergence.jsonl and convergence_curves.jsonl of one harness run (their shared `run` field;
default the latest), the runs that had a reference.
"""

import math
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional

from benchmarks.convergence.references import FINAL_LOSS, read_rows
from benchmarks.convergence.runs import REPO

DEFAULT_OUT = REPO / "docs" / "img" / "convergence.png"
ZOOM_FRACTION = 0.25


class Curve(NamedTuple):
    name: str
    iterations: List[int]
    losses: List[float]
    ratios: Optional[List[float]]  # to the BF16 reference's loss at the same iteration; None: no reference
    final_deviation: Optional[float]  # final validation loss vs the reference's, in %


def title(gpu, commit, concurrent_runs, run) -> str:
    return f"convergence proxy, {gpu or '?'}, commit {commit or '?'}, {concurrent_runs or '?'} runs sharing the GPU, run {run or '?'}"


def rows_of_run(rows: List[dict], run_id: Optional[str]) -> List[dict]:
    """The rows of harness run `run_id` (default: the latest run present)."""
    if not rows:
        return []
    run_id = run_id or max(row.get("run", "") for row in rows)
    return [row for row in rows if row.get("run", "") == run_id]


def final_deviations(rows: List[dict]) -> Dict[str, float]:
    """Per run, the final whole-validation loss's deviation from its BF16 reference, in %."""
    return {row["case"]: (row["ratio"] - 1.0) * 100.0 for row in rows if row["metric"] == FINAL_LOSS}


def curves_of_rows(curve_rows: List[dict], result_rows: List[dict]) -> List[Curve]:
    by_case = defaultdict(list)
    for row in curve_rows:
        by_case[row["case"]].append(row)
    finals = final_deviations(result_rows)
    curves = []
    for case, points in by_case.items():
        points.sort(key=lambda r: r["iteration"])
        curves.append(Curve(case, [p["iteration"] for p in points], [p["value"] for p in points],
                            [p["ratio"] for p in points], finals.get(case)))
    return curves


def draw(curves: List[Curve], heading: str, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    last = max(curve.iterations[-1] for curve in curves)
    zoom_from = last * (1.0 - ZOOM_FRACTION)
    fig, (full, zoom, deviation) = plt.subplots(1, 3, figsize=(18, 5.5))
    for curve in curves:
        final = f" (final val {curve.final_deviation:+.2f}%)" if curve.final_deviation is not None else ""
        label = curve.name + final + ("" if curve.ratios is not None else " (no BF16 reference)")
        line, = full.plot(curve.iterations, curve.losses, linewidth=1, label=label)
        tail = [(i, v) for i, v in zip(curve.iterations, curve.losses) if i >= zoom_from]
        if tail:
            zoom.plot(*zip(*tail), linewidth=1, color=line.get_color())
        if curve.ratios is not None:
            deviation.plot(curve.iterations, [(r - 1.0) * 100.0 if math.isfinite(r) else math.nan for r in curve.ratios],
                           linewidth=1, color=line.get_color())
    full.set(title="lm loss (training, every log interval)", xlabel="iteration", ylabel="nats/token")
    zoom.set(title=f"last {ZOOM_FRACTION:.0%} of the iterations", xlabel="iteration", ylabel="nats/token")
    deviation.set(title="deviation from the BF16 reference of the same data order", xlabel="iteration", ylabel="%")
    deviation.axhline(0.0, color="black", linewidth=0.5)
    full.legend(fontsize=7)
    for axis in (full, zoom, deviation):
        axis.grid(alpha=0.3)
    fig.suptitle(heading)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_rows(results: Path, run_id: Optional[str], out: Path) -> Path:
    """The plot of one harness run's stored rows in the folder `results`; SystemExit with one
    sentence when there are none to plot."""
    curve_rows = rows_of_run(read_rows(results / "convergence_curves.jsonl"), run_id)
    if not curve_rows:
        which = f"of run {run_id} " if run_id else ""
        raise SystemExit(f"error: no convergence_curves rows {which}in {results}: curves are written for runs "
                         "compared with a BF16 run; to plot every run of an out dir from its logs, use "
                         "`python -m benchmarks.convergence from-logs DIR --plot PNG`.")
    sample = curve_rows[0]
    result_rows = rows_of_run(read_rows(results / "convergence.jsonl"), sample["run"])
    heading = title(sample.get("gpu"), sample.get("commit"), sample.get("concurrent_runs"), sample.get("run"))
    return draw(curves_of_rows(curve_rows, result_rows), heading, out)
