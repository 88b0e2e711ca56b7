"""Plot the convergence rows (benchmarks/bench_convergence.py) as one PNG: the lm loss curves of
every run, a zoom on the last quarter of the iterations, and each run's deviation from its BF16
reference at the same iteration (value / reference - 1, in %), with the final whole-validation
deviations in the legend.

    python -m benchmarks.plot_convergence [--results DIR] [--run RUN_ID] [--out docs/convergence.png]

Reads convergence.jsonl and convergence_curves.jsonl from DIR (default $MEGATRON_FP4_BENCH_RESULTS or
benchmarks/results/) and plots the rows of one harness run (their shared `run` field; default the latest).
"""

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional

from benchmarks.rows import results_dir

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "docs" / "convergence.png"
FINAL_METRIC = "final validation loss (whole split)"
ZOOM_FRACTION = 0.25


def read_rows(path: Path) -> List[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rows_of_run(rows: List[dict], run_id: Optional[str]) -> List[dict]:
    """The rows of harness run `run_id` (default: the latest run present)."""
    if not rows:
        return []
    run_id = run_id or max(row.get("run", "") for row in rows)
    return [row for row in rows if row.get("run", "") == run_id]


def curves_by_case(rows: List[dict]) -> Dict[str, List[dict]]:
    curves = defaultdict(list)
    for row in rows:
        curves[row["case"]].append(row)
    return {case: sorted(points, key=lambda r: r["iteration"]) for case, points in curves.items()}


def final_deviations(rows: List[dict]) -> Dict[str, float]:
    """Per run, the final whole-validation loss's deviation from its BF16 reference, in %."""
    return {row["case"]: (row["ratio"] - 1.0) * 100.0 for row in rows if row["metric"] == FINAL_METRIC}


def plot(curve_rows: List[dict], result_rows: List[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = curves_by_case(curve_rows)
    if not curves:
        raise SystemExit("error: no convergence_curves rows to plot; run benchmarks/bench_convergence.py first.")
    finals = final_deviations(result_rows)
    last = max(points[-1]["iteration"] for points in curves.values())
    zoom_from = last * (1.0 - ZOOM_FRACTION)
    fig, (full, zoom, deviation) = plt.subplots(1, 3, figsize=(18, 5.5))
    for case, points in curves.items():
        iterations = [p["iteration"] for p in points]
        losses = [p["value"] for p in points]
        final = f" (final val {finals[case]:+.2f}%)" if case in finals else ""
        line, = full.plot(iterations, losses, linewidth=1, label=f"{case}{final}")
        tail = [(i, v) for i, v in zip(iterations, losses) if i >= zoom_from]
        if tail:
            zoom.plot(*zip(*tail), linewidth=1, color=line.get_color())
        deviation.plot(iterations, [(p["ratio"] - 1.0) * 100.0 for p in points], linewidth=1, color=line.get_color())
    full.set(title="lm loss (training, every log interval)", xlabel="iteration", ylabel="nats/token")
    zoom.set(title=f"last {ZOOM_FRACTION:.0%} of the iterations", xlabel="iteration", ylabel="nats/token")
    deviation.set(title="deviation from the BF16 reference of the same seed", xlabel="iteration", ylabel="%")
    deviation.axhline(0.0, color="black", linewidth=0.5)
    full.legend(fontsize=7)
    for axis in (full, zoom, deviation):
        axis.grid(alpha=0.3)
    sample = curve_rows[0]
    fig.suptitle(f"convergence proxy, {sample.get('gpu', '?')}, commit {sample.get('commit', '?')}, "
                 f"{sample.get('concurrent_runs', '?')} runs sharing the GPU, run {sample.get('run', '?')}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.plot_convergence", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=None, help="folder of the .jsonl rows (default: the rows' folder)")
    p.add_argument("--run", default=None, help="the harness run's `run` field (default: the latest)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="PNG to write (default %(default)s)")
    args = p.parse_args(argv)
    directory = args.results or results_dir()
    curve_rows = rows_of_run(read_rows(directory / "convergence_curves.jsonl"), args.run)
    run_id = curve_rows[0]["run"] if curve_rows else args.run
    result_rows = rows_of_run(read_rows(directory / "convergence.jsonl"), run_id)
    print(f"wrote {plot(curve_rows, result_rows, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
