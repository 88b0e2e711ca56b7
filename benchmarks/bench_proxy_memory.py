#!/usr/bin/env python3
"""The one-GPU memory-cap proxies (configs/proxy/memcap1_*.yaml) trained one after another through
scripts/launch.py: which fit under the cap, each run's peak memory against `megatron-fp4
estimate`, and tokens/s, as the paper's table compares BF16, FP8 and FP4 at three recompute scopes.

    python -m benchmarks.bench_proxy_memory                         # the default runs, one GPU
    python -m benchmarks.bench_proxy_memory --dry-run               # the runs, commands and estimates only
    python -m benchmarks.bench_proxy_memory --runs memcap1_fp4_attn memcap1_fp8_attn:uncapped
    python -m benchmarks.bench_proxy_memory --rounds 3 --runs memcap1_fp8_attn_ln_moe memcap1_fp4_attn

A run named CONFIG trains under the config's cluster.gpu_memory_gib (--enforce-memory-cap);
CONFIG:uncapped on the whole GPU. The default runs: every precision at every scope under the cap,
heaviest first, but BF16 and FP8 at the lightest scope (--every-capped adds those), then FP8 and
BF16 at the lightest scope uncapped. A run that stops with CUDA out of memory counts as "does not
fit"; one past --time-limit is stopped. Each run's output goes to RUNS_DIR/<config>_<capped|
uncapped>.log (and the launcher's run directory next to it); the progress lines show its iterations
and Megatron's memory reports. --rounds N trains the runs N times in turns (A B A B ...; round r > 1
logs to <config>_<capped|uncapped>_round<r>.log), a run that did not train in round 1 only once: a
run's tokens/s is then the median over its rounds (each round's is in the row), its peaks the
largest, so that one call's comparison does not rest on one run of each.

Read from each log: the last "[Rank 0] (after N iterations) memory (MB)" report (max allocated /
max reserved: the run's peaks), tokens/s per GPU from the iteration lines after --warmup
iterations (global batch x sequence length / elapsed time per iteration), and PyTorch's
out-of-memory message. Rows: bench proxy_memory (max allocated against the estimate; the
allocator's peak, or what it wanted at the OOM, against the cap; FP4's peak against FP8's at the
same scope) and bench proxy_throughput (tokens/s against BF16 at the same scope, FP4's also against
FP8's; each precision's best fitting run under the cap against FP8's), appended to $MEGATRON_FP4_BENCH_RESULTS (default
benchmarks/results/). A table of the runs ends the output. Exit status 0 when every run started
(see --budget-s) and ended as trained or OOM, 1 otherwise (a refusal, a crash, a time-out).
"""

import argparse
import sys
import time
from pathlib import Path

from benchmarks import proxy_log
from benchmarks.proxy_rows import Estimate, measure, memory_rows, merge_rounds, summary, throughput_rows
from benchmarks.proxy_runs import REPO, default_runs, execute, launch_command, parse_run
from benchmarks.rows import Recorder


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_proxy_memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", metavar="CONFIG[:uncapped]",
                   help="configs/proxy/ names without .yaml, in order (default: the runs above)")
    p.add_argument("--every-capped", action="store_true",
                   help="default runs: also BF16 and FP8 at the lightest scope under the cap")
    p.add_argument("--budget-s", type=float, default=None, metavar="S",
                   help="seconds for all runs: a run that could not finish inside what is left is not started "
                        "(listed as such), and the rows of the runs before it are still written")
    p.add_argument("--rounds", type=int, default=1, metavar="N",
                   help="train the runs N times in turns; tokens/s is the median over the rounds (default 1)")
    p.add_argument("--time-limit", type=float, default=150.0, metavar="S",
                   help="seconds one run may take before it is stopped (default 150)")
    p.add_argument("--train-iters", type=int, metavar="N", help="override the configs' train_iters (30)")
    p.add_argument("--warmup", type=int, default=10, metavar="N",
                   help="iterations left out of tokens/s (default 10; the configs log every 5)")
    p.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "proxy_memory",
                   help="where the logs and run directories go (default runs/proxy_memory)")
    p.add_argument("--dry-run", action="store_true",
                   help="print each run's launch command and estimate, start nothing, write no rows")
    return p.parse_args(argv)


def estimate_of(path: Path):
    """The estimator's peak for the config (the installed package's memory), or None if it refuses."""
    from megatron_fp4.estimator import EstimateError, estimate
    from megatron_fp4.options import UnsupportedConfiguration

    try:
        e = estimate(path, "installed")
    except (EstimateError, UnsupportedConfiguration) as err:
        print(f"  estimate of {path.name}: {err}")
        return None
    return Estimate(peak_mib=e.peak_gib * 1024, fits=e.fits)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from megatron_fp4.console import quiet_third_party_notices
    from megatron_fp4.run_config import load_config

    quiet_third_party_notices()
    try:
        runs = [parse_run(text) for text in args.runs] if args.runs else default_runs(args.every_capped)
    except ValueError as err:
        print(f"error: {err}.", file=sys.stderr)
        return 2
    if args.rounds < 1:
        print(f"error: --rounds must be at least 1, got {args.rounds}.", file=sys.stderr)
        return 2
    configs = {run.config: load_config(run.path) for run in runs}
    estimates = {config: estimate_of(configs[config].path) for config in configs}
    rounds = 1 if args.dry_run else args.rounds
    print(f"{len(runs)} runs{f' x {rounds} rounds' if rounds > 1 else ''}, {args.time_limit:g} s each at most; "
          f"logs in {args.runs_dir}")
    by_run = {run: [] for run in runs}  # each run's Measured, round by round
    not_started, begun = [], time.monotonic()
    for round_ in range(1, rounds + 1):
        # After round 1, only the runs that trained (an out-of-memory run would end the same way again).
        todo = runs if round_ == 1 else [run for run in runs if by_run[run] and by_run[run][0].trained]
        for n, run in enumerate(todo, 1):
            if args.budget_s is not None and not args.dry_run and \
                    time.monotonic() - begun + args.time_limit > args.budget_s:
                not_started = [f"{r}{f' (round {round_})' if rounds > 1 else ''}" for r in todo[n - 1:]]
                print(f"--budget-s {args.budget_s:g}: not started: {', '.join(not_started)}", flush=True)
                break
            config = configs[run.config]
            cap = config.cluster.get("gpu_memory_gib")
            e = estimates[run.config]
            expected = "-" if e is None else f"{e.peak_mib / 1024:.2f} GiB estimated" + (
                "" if not run.capped or e.fits is None else (", fits" if e.fits else ", over the cap"))
            where = f"round {round_}, " if rounds > 1 else ""
            print(f"[{where}{n}/{len(todo)}] {run} ({f'cap {cap:g} GiB' if run.capped else 'no cap'}; {expected})",
                  flush=True)
            if args.dry_run:
                print("    " + " ".join(launch_command(run, args.train_iters)))
                continue
            started = time.monotonic()
            log_name = run.name + (f"_round{round_}" if round_ > 1 else "")
            result = execute(run, args.runs_dir / f"{log_name}.log", args.time_limit, args.train_iters,
                             progress=lambda line: print(line, flush=True))
            m = measure(result, cap, int(config.flags["seq_length"]), args.warmup, estimate=e)
            by_run[run].append(m)
            detail = m.error if not m.trained else (
                f"max allocated {m.max_allocated_mib} MiB, " if m.max_allocated_mib else "no memory report, ") + (
                f"{m.tokens_per_s:.0f} tokens/s" if m.tokens_per_s else "no tokens/s")
            print(f"    -> {m.outcome} in {time.monotonic() - started:.0f} s: {detail}", flush=True)
        if not_started:
            break
    if args.dry_run:
        return 0
    measured = [merge_rounds(by_run[run]) for run in runs if by_run[run]]
    memory, throughput = Recorder("proxy_memory", gpus=1), Recorder("proxy_throughput", gpus=1)
    print(memory.description())
    memory_rows(memory, measured)
    throughput_rows(throughput, measured, args.warmup)
    memory.write()
    throughput.write()
    print(summary(measured))
    expected_endings = (*proxy_log.TRAINED_OUTCOMES, proxy_log.OUT_OF_MEMORY)
    return 0 if not not_started and all(m.outcome in expected_endings for m in measured) else 1


if __name__ == "__main__":
    sys.exit(main())
