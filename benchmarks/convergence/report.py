"""What the harness makes of its runs' logs: the summary it prints, the rows it writes and the plot.

Rows (benchmarks/rows.py) go to $MEGATRON_FP4_BENCH_RESULTS (default benchmarks/results/):
convergence.jsonl (bench=convergence: per run the iterations completed and, when it has a BF16
reference (references.py), the final validation loss against the reference's, the largest loss
jump and tokens/s; the BF16 repeat and the BF16 run with another init and the same data order are
the noise rows) and convergence_curves.jsonl (bench=convergence_curves: one row per logged
iteration per run with a reference). Each row carries the validation set's SHA-256 (printed by the
trainer) and whether it equals the reference's. Tokens/s: the runs share the GPU, so they are not
comparable with a run alone, and are written only where the reference trained on as many GPUs in
the same invocation.
"""

import math
from pathlib import Path
from typing import Dict, List, Optional

from benchmarks.convergence import plot
from benchmarks.convergence.harness import run_gpus
from benchmarks.convergence.log import RunLog, largest_jump, read_log, tokens_per_second
from benchmarks.convergence.references import FINAL_LOSS, Reference, resolve_references
from benchmarks.convergence.runs import Run, role
from benchmarks.rows import Recorder

LOSS_UNIT = "nats/token"


def write_rows(runs: List[Run], logs: Dict[str, RunLog], status: Dict[str, str], iters: int, corpus_info: dict,
               info: Optional[dict] = None, refs: Optional[Dict[str, Reference]] = None,
               concurrent_runs: Optional[int] = None) -> dict:
    """The rows of `runs` (info: the rows' run_info, default this machine's now; refs: default the
    references among `runs`); returns the rows' run info."""
    refs = resolve_references(runs, logs) if refs is None else refs
    shared = {"iters": iters, "corpus_sha256": corpus_info["corpus_sha256"], "corpus_tokens": corpus_info["corpus_tokens"],
              "concurrent_runs": concurrent_runs or len(runs)}
    results, curves = Recorder("convergence", gpus=1, **shared), Recorder("convergence_curves", gpus=1, **shared)
    if info is not None:
        results.info = dict(info)
    curves.info = results.info  # one `run` time for both files (the plot pairs them by it)
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
            continue  # resolve_references said why
        ref_log, label = reference.log, reference.label
        about.update(role=role(run, reference.run), reference_run=reference.run.name,
                     same_validation_set=log.validation_sha256 is not None
                     and log.validation_sha256 == ref_log.validation_sha256)
        if reference.source is not None:
            about["reference_dir"] = str(reference.source)
        if reference.rows_of is not None:
            about["reference_rows"] = reference.rows_of
        if log.final_validation_loss is not None and ref_log.final_validation_loss is not None:
            results.add(run.name, FINAL_LOSS, log.final_validation_loss, LOSS_UNIT,
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
    return results.info


def summary(runs: List[Run], logs: Dict[str, RunLog], status: Dict[str, str], refs: Dict[str, Reference]) -> None:
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


def curves_of_logs(runs: List[Run], logs: Dict[str, RunLog], refs: Dict[str, Reference]) -> List[plot.Curve]:
    """Every run that logged a training loss, as the plot draws it: its deviation from its BF16
    reference where it has one."""
    drawn = []
    for run in runs:
        log, reference = logs[run.name], refs.get(run.name)
        points = [p for p in log.points if math.isfinite(p.lm_loss)]
        if not points:
            continue
        ratios, final = None, None
        if reference is not None:
            ref_losses = {p.iteration: p.lm_loss for p in reference.log.points}
            ratios = [p.lm_loss / ref_losses[p.iteration] if ref_losses.get(p.iteration) else math.nan
                      for p in points]
            if log.final_validation_loss is not None and reference.log.final_validation_loss:
                final = (log.final_validation_loss / reference.log.final_validation_loss - 1.0) * 100.0
        drawn.append(plot.Curve(run.name, [p.iteration for p in points], [p.lm_loss for p in points], ratios, final))
    return drawn


def report(runs: List[Run], out_dir: Path, status: Dict[str, str], iters: int, corpus_info: dict, info: dict,
           reference_dir: Optional[Path] = None, concurrent_runs: Optional[int] = None,
           reference_rows: Optional[Path] = None, plot_to: Optional[Path] = None) -> Dict[str, RunLog]:
    """Parse every run's log, print the summary, write the rows, and draw the plot to `plot_to`."""
    logs = {run.name: read_log(out_dir / run.name) for run in runs}
    refs = resolve_references(runs, logs, reference_dir, corpus_info["corpus_sha256"], reference_rows, iters)
    summary(runs, logs, status, refs)
    info = write_rows(runs, logs, status, iters, corpus_info, info, refs, concurrent_runs)
    if plot_to is not None:
        curves = curves_of_logs(runs, logs, refs)
        if curves:
            title = plot.title(info.get("gpu"), info.get("commit"), concurrent_runs or len(runs), info.get("run"))
            print(f"wrote {plot.draw(curves, title, plot_to)}")
        else:
            print(f"no plot: no run logged a training loss (their logs: {out_dir}/<run>/train_node0.log)")
    return logs
