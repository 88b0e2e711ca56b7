"""Convergence on real text: BF16, FP8 and FP4 runs of the convergence proxy (configs/convergence/)
trained side by side on one GPU, then their final whole-validation loss against BF16 of the same seed.

    python -m benchmarks.bench_convergence                        # the default runs, 2000 iterations
    python -m benchmarks.bench_convergence --iters 20 --runs bf16,fp4 --budget-s 100   # smoke
    python -m benchmarks.bench_convergence --run "bf16_lr2 bf16 1234 --lr 2e-3"        # a run of your own

Builds the corpus when its prefix is missing (megatron_fp4.corpus: this machine's standard library
and torch sources), refuses runs that would see one epoch or more of its train split, then starts
every run at once, each through scripts/launch.py (torchrun --standalone: each its own free
rendezvous port) with its own run directory, log and dataset index cache, and prints which run is at
which iteration until all end or --budget-s passes (then the rest are stopped and reported as not
finished). From each log (benchmarks/convergence_log.py): the lm loss every --log-interval, Megatron's
final validation over the whole validation split, NaN and skipped iterations, the largest
step-to-step rise of the logged loss, tokens/s (the runs share the GPU: not comparable to a run alone).

Rows (benchmarks/rows.py) go to $MEGATRON_FP4_BENCH_RESULTS (default benchmarks/results/):
convergence.jsonl (bench=convergence: per run the final validation loss with reference = the BF16 run
of the same seed and data order, the largest loss jump, tokens/s, iterations completed; the BF16
repeat and the BF16 run with another init and the same data order are the noise rows) and
convergence_curves.jsonl (bench=convergence_curves: one row per logged iteration per run). Each row
carries the validation set's SHA-256 (printed by the trainer) and whether it equals the reference's.

Seeds: --seed sets the model's initialization; the data order (the GPTDataset shuffle and the
sample windows, validation included) follows MEGATRON_FP4_DATA_SEED when a run names a data seed
(launch/data_order.py), else --seed. A run spec is "NAME CONFIG SEED [data_seed=N] [FLAGS ...]",
CONFIG a name in configs/convergence/ or a path.
"""

import argparse
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from benchmarks.convergence_log import RunLog, largest_jump, parse_log, tokens_per_second
from benchmarks.rows import Recorder
from megatron_fp4.console import quiet_third_party_notices

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs" / "convergence"
LAUNCH = REPO / "scripts" / "launch.py"
DEFAULT_CORPUS = REPO / "runs" / "corpus" / "python_sources"
REFERENCE_CONFIG = "bf16"
SEEDS = (1234, 5678)
LOSS_UNIT = "nats/token"
STOP_GRACE_S = 15


@dataclass(frozen=True)
class Run:
    name: str
    config: str
    seed: int
    data_seed: Optional[int] = None  # None: the data order follows --seed
    flags: tuple = field(default_factory=tuple)

    @property
    def order(self) -> int:
        """The seed of the data order."""
        return self.seed if self.data_seed is None else self.data_seed

    def config_path(self) -> Path:
        path = Path(self.config)
        return path if path.suffix == ".yaml" else CONFIGS / f"{self.config}.yaml"


def _catalogue() -> Dict[str, Run]:
    first, second = SEEDS
    runs = [Run(precision, precision, first) for precision in ("bf16", "fp8", "fp4")]
    runs += [Run(f"{precision}_seed2", precision, second) for precision in ("bf16", "fp8", "fp4")]
    runs += [Run("bf16_repeat", "bf16", first),  # the kernels' nondeterminism
             Run("bf16_init2", "bf16", second, data_seed=first)]  # another init, the same data order
    runs += [Run(name, name, first) for name in ("fp4_dispatch", "fp4_dispatch_experts", "fp4_dispatch_experts_linears")]
    return {run.name: run for run in runs}


CATALOGUE = _catalogue()
DEFAULT_RUNS = ("bf16", "fp8", "fp4", "bf16_seed2", "fp8_seed2", "fp4_seed2", "bf16_repeat", "bf16_init2",
                "fp4_dispatch", "fp4_dispatch_experts")


def parse_run_spec(text: str) -> Run:
    """"NAME CONFIG SEED [data_seed=N] [FLAGS ...]" -> Run."""
    words = shlex.split(text)
    if len(words) < 3 or not words[2].lstrip("-").isdigit():
        raise ValueError(f"run spec {text!r}: expected 'NAME CONFIG SEED [data_seed=N] [FLAGS ...]'")
    data_seed, flags = None, words[3:]
    if flags and flags[0].startswith("data_seed="):
        data_seed, flags = int(flags[0].split("=", 1)[1]), flags[1:]
    return Run(words[0], words[1], int(words[2]), data_seed, tuple(flags))


def references(runs: List[Run]) -> Dict[str, Run]:
    """Each run's BF16 reference among `runs`: the first plain BF16 run (config bf16, no extra flags,
    data order from its seed) of the run's seed when the run's data order follows that seed (a plain
    BF16 run is thus its own reference), else the first plain BF16 run whose seed is the run's data
    seed (the same data order, another init). Runs without either are left out."""
    plain = {}
    for run in runs:
        if run.config == REFERENCE_CONFIG and not run.flags and run.data_seed is None:
            plain.setdefault(run.seed, run)
    chosen = {}
    for run in runs:
        reference = plain.get(run.seed) if run.order == run.seed else plain.get(run.order)
        if reference is not None:
            chosen[run.name] = reference
    return chosen


def role(run: Run, reference: Run) -> str:
    if run is reference:
        return "reference"
    if run.config != REFERENCE_CONFIG or run.flags:
        return "compared"
    return "noise: repeat (same seed, same data)" if run.seed == reference.seed else "noise: init (same data order)"


def command(run: Run, iters: int, corpus: Path, run_dir: Path) -> List[str]:
    return [sys.executable, str(LAUNCH), str(run.config_path()), "--train-iters", str(iters), "--seed", str(run.seed),
            "--data-path", str(corpus), "--data-cache-path", str(run_dir / "index_cache"), *run.flags]


def environment(run: Run, run_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MEGATRON_FP4_DATA_SEED", "RUN_ID", "NNODES")}
    env["RUN_DIR"] = str(run_dir)
    if run.data_seed is not None:
        env["MEGATRON_FP4_DATA_SEED"] = str(run.data_seed)
    return env


def config_numbers(run: Run) -> dict:
    """The settings of a run's config that size it (its flags win)."""
    from megatron_fp4.run_config import load_config, planned_args

    args = planned_args(load_config(run.config_path()), list(run.flags))
    return {"global_batch_size": args.global_batch_size, "seq_length": args.seq_length, "split": args.split}


def check_less_than_one_epoch(runs: List[Run], iters: int, corpus: Path) -> dict:
    """Tokens per run against the corpus's train split; raises SystemExit for one epoch or more."""
    from megatron_fp4.corpus import read_record, split_tokens

    record = read_record(corpus)
    sizes, train_tokens = {}, {}
    for run in runs:
        numbers = config_numbers(run)
        if numbers["split"] not in train_tokens:
            train_tokens[numbers["split"]] = split_tokens(corpus, numbers["split"])[0]
        train = train_tokens[numbers["split"]]
        tokens = iters * numbers["global_batch_size"] * numbers["seq_length"]
        if tokens >= train:
            raise SystemExit(f"error: run {run.name} would train on {tokens} tokens, {tokens / train:.2f} epochs of "
                             f"the corpus's {train}-token train split; lower --iters or build a larger corpus.")
        sizes[run.name] = {"tokens_per_iteration": numbers["global_batch_size"] * numbers["seq_length"],
                           "tokens_per_run": tokens, "train_split_tokens": train}
    return {"corpus_sha256": record["sha256"], "corpus_tokens": record["tokens"], "sizes": sizes}


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the run's process group (launch.py, torchrun, the trainer), SIGKILL after a grace."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(STOP_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue


def read_log(run_dir: Path) -> RunLog:
    log = run_dir / "train_node0.log"
    return parse_log(log.read_text(errors="replace")) if log.exists() else RunLog()


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


def run_all(runs: List[Run], iters: int, corpus: Path, out_dir: Path, budget_s: float, poll_s: float) -> Dict[str, str]:
    """Start every run, report progress, stop what is left at the budget; returns each run's status."""
    processes = {}
    for run in runs:
        run_dir = out_dir / run.name
        run_dir.mkdir(parents=True, exist_ok=True)
        argv = command(run, iters, corpus, run_dir)
        (run_dir / "harness_command.txt").write_text(shlex.join(argv) + "\n")
        with open(run_dir / "launch.out", "wb") as out:
            processes[run.name] = subprocess.Popen(argv, env=environment(run, run_dir), cwd=REPO, stdout=out,
                                                   stderr=subprocess.STDOUT, start_new_session=True)
        print(f"started {run.name}: {run.config_path().name}, seed {run.seed}, data order {run.order}, {run_dir}",
              flush=True)
    start, status = time.monotonic(), {}
    while len(status) < len(runs):
        time.sleep(poll_s)
        elapsed = time.monotonic() - start
        for name, process in processes.items():
            if name not in status and process.poll() is not None:
                status[name] = "finished" if process.returncode == 0 else f"failed (exit {process.returncode})"
        if elapsed > budget_s:
            for name, process in processes.items():
                if name not in status:
                    stop(process)
                    status[name] = f"stopped at the {budget_s:g} s budget"
        logs = {run.name: read_log(out_dir / run.name) for run in runs}
        print(progress_line(elapsed, runs, logs, iters, status), flush=True)
    return status


def write_rows(runs: List[Run], logs: Dict[str, RunLog], status: Dict[str, str], iters: int, corpus_info: dict) -> None:
    refs = references(runs)
    shared = {"iters": iters, "corpus_sha256": corpus_info["corpus_sha256"], "corpus_tokens": corpus_info["corpus_tokens"],
              "concurrent_runs": len(runs)}
    results, curves = Recorder("convergence", gpus=1, **shared), Recorder("convergence_curves", gpus=1, **shared)
    curves.info = results.info  # one `run` time for both files (plot_convergence.py pairs them by it)
    print(results.description())
    for run in runs:
        log, reference = logs[run.name], refs.get(run.name)
        sizes = corpus_info["sizes"][run.name]
        about = {"config": run.config_path().name, "seed": run.seed, "data_seed": log.data_seed, "status": status[run.name],
                 "validation_samples": log.validation_samples, "validation_sha256": log.validation_sha256,
                 "nan_iterations": log.nan_iterations, "skipped_iterations": log.skipped_iterations,
                 "flags": list(run.flags), **sizes}
        results.add(run.name, "iterations completed", log.last_iteration, "iterations", "iterations asked", iters,
                    better="closer_to_1", **about)
        if reference is None:
            print(f"{run.name}: no BF16 run of the same data order among the runs: no comparison rows")
            continue
        ref_log = logs[reference.name]
        about.update(role=role(run, reference), reference_run=reference.name,
                     same_validation_set=log.validation_sha256 is not None
                     and log.validation_sha256 == ref_log.validation_sha256)
        if log.final_validation_loss is not None and ref_log.final_validation_loss is not None:
            results.add(run.name, "final validation loss (whole split)", log.final_validation_loss, LOSS_UNIT,
                        f"BF16 {reference.name}", ref_log.final_validation_loss, better="closer_to_1", **about)
        jump, at = largest_jump(log.points)
        ref_jump, _ = largest_jump(ref_log.points)
        if jump > 0 and ref_jump > 0:
            results.add(run.name, "largest step-to-step loss rise", jump, LOSS_UNIT, f"BF16 {reference.name}", ref_jump,
                        better="lower", at_iteration=at, **about)
        rate, ref_rate = (tokens_per_second(l.points, sizes["tokens_per_iteration"]) for l in (log, ref_log))
        if rate and ref_rate:
            results.add(run.name, "tokens per second (GPU shared by all runs)", rate, "tokens/s",
                        f"BF16 {reference.name}", ref_rate, better="higher", **about)
        ref_losses = {p.iteration: p.lm_loss for p in ref_log.points}
        for point in log.points:
            if math.isfinite(point.lm_loss) and math.isfinite(ref_losses.get(point.iteration, math.nan)):
                curves.add(run.name, "lm loss", point.lm_loss, LOSS_UNIT, f"BF16 {reference.name}",
                           ref_losses[point.iteration], better="closer_to_1", iteration=point.iteration,
                           role=about["role"], reference_run=reference.name, seed=run.seed)
    results.write()
    curves.write()


def summary(runs: List[Run], logs: Dict[str, RunLog], status: Dict[str, str]) -> None:
    refs = references(runs)
    print(f"{'run':<30} {'status':<30} {'iters':>6} {'val loss':>9} {'vs BF16':>8} {'nan':>4} {'jump':>7}  validation set")
    for run in runs:
        log, reference = logs[run.name], refs.get(run.name)
        ref_loss = logs[reference.name].final_validation_loss if reference else None
        vs = (f"{(log.final_validation_loss / ref_loss - 1) * 100:+.2f}%"
              if log.final_validation_loss is not None and ref_loss else "-")
        loss = f"{log.final_validation_loss:.4f}" if log.final_validation_loss is not None else "-"
        print(f"{run.name:<30} {status[run.name]:<30} {log.last_iteration:>6} {loss:>9} {vs:>8} {log.nan_iterations:>4} "
              f"{largest_jump(log.points)[0]:>7.4f}  {(log.validation_sha256 or '-')[:16]}")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_convergence", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", default=",".join(DEFAULT_RUNS),
                   help=f"comma-separated run names from: {', '.join(CATALOGUE)} (default: %(default)s); '' for none")
    p.add_argument("--run", action="append", default=[], metavar="SPEC", type=parse_run_spec,
                   help="an extra run: 'NAME CONFIG SEED [data_seed=N] [FLAGS ...]' (repeatable)")
    p.add_argument("--iters", type=int, default=2000, help="training iterations per run (default %(default)s)")
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS,
                   help="corpus prefix; built from this machine's Python sources when missing (default %(default)s)")
    p.add_argument("--out-dir", type=Path, default=None, help="run directories (default runs/convergence_<time>)")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="wall-clock seconds for the runs, after which the rest are stopped (default %(default)s)")
    p.add_argument("--poll-s", type=float, default=10.0, help="seconds between progress lines (default %(default)s)")
    p.add_argument("--plot", type=Path, default=None, help="also write the plot (benchmarks/plot_convergence.py) here")
    p.add_argument("--dry-run", action="store_true", help="check the runs and print their commands, start nothing")
    args = p.parse_args(argv)
    names = [n for n in args.runs.split(",") if n]
    unknown = [n for n in names if n not in CATALOGUE]
    if unknown:
        p.error(f"unknown run(s) {', '.join(unknown)}; known: {', '.join(CATALOGUE)}")
    args.selected = [CATALOGUE[n] for n in names] + args.run
    if not args.selected:
        p.error("no runs: give --runs or --run")
    if len({r.name for r in args.selected}) != len(args.selected):
        p.error("two runs share a name")
    return args


def main(argv=None) -> int:
    quiet_third_party_notices()  # before Megatron is imported
    args = parse_args(argv)
    runs = args.selected
    corpus = args.corpus.resolve()
    if not Path(f"{corpus}.idx").exists():
        from megatron_fp4.corpus import build_corpus

        print(f"building the corpus {corpus} ...", flush=True)
        build_corpus(corpus)
    corpus_info = check_less_than_one_epoch(runs, args.iters, corpus)
    for run in runs:
        sizes = corpus_info["sizes"][run.name]
        print(f"{run.name}: {sizes['tokens_per_iteration']} tokens/iteration, {sizes['tokens_per_run']} per run, "
              f"{sizes['tokens_per_run'] / sizes['train_split_tokens']:.2f} epochs of the train split")
    out_dir = (args.out_dir or REPO / "runs" / time.strftime("convergence_%Y%m%d_%H%M%S")).resolve()
    if args.dry_run:
        from megatron_fp4.options import UnsupportedConfiguration
        from megatron_fp4.run_config import ConfigError, load_config, validate_config

        for run in runs:
            try:  # what scripts/launch.py --dry-run checks
                validate_config(load_config(run.config_path()), command(run, args.iters, corpus, out_dir)[3:])
            except (ConfigError, UnsupportedConfiguration) as err:
                print(f"error: run {run.name}: {err}", file=sys.stderr)
                return 2
            seed = f"MEGATRON_FP4_DATA_SEED={run.data_seed} " if run.data_seed is not None else ""
            print(seed + shlex.join(command(run, args.iters, corpus, out_dir / run.name)))
        return 0
    status = run_all(runs, args.iters, corpus, out_dir, args.budget_s, args.poll_s)
    logs = {run.name: read_log(out_dir / run.name) for run in runs}
    summary(runs, logs, status)
    write_rows(runs, logs, status, args.iters, corpus_info)
    if args.plot is not None:
        from benchmarks import plot_convergence

        plot_convergence.main(["--out", str(args.plot)])
    return 0 if all(s == "finished" for s in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
