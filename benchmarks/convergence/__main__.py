"""python -m benchmarks.convergence MODE ...: the convergence proxy's one entry point (docs/convergence.md).

    python -m benchmarks.convergence train                        # the default runs, 2000 iterations
    python -m benchmarks.convergence train --iters 20 --runs bf16,fp4 --budget-s 100    # smoke
    python -m benchmarks.convergence train --run "bf16_lr2 bf16 1234 --lr 2e-3"        # a run of your own
    python -m benchmarks.convergence from-logs DIR [--reference-from DIR2]            # rows from logs
    python -m benchmarks.convergence seeds --configs fp8.yaml fp4.yaml                # deviations by seed
    python -m benchmarks.convergence plot --out docs/img/convergence.png              # a plot of stored rows

train builds the corpus when its prefix is missing (megatron_fp4.corpus: this machine's standard
library and torch sources), refuses runs that would see one epoch or more of its train split, trains
every run side by side (harness.py), then prints the summary and writes the rows (report.py). At
start it writes corpus.json (the corpus record the rows need) and harness.json (the rows' GPU,
versions, commit and start time, the iterations, the runs) into the out dir; from-logs DIR writes the
summary and rows of DIR's logs without launching (status "re-read from DIR").
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

from benchmarks.convergence import harness, plot, seeds
from benchmarks.convergence.log import read_log
from benchmarks.convergence.report import report
from benchmarks.convergence.runs import (CATALOGUE, CORPUS_JSON, DEFAULT_RUNS, HARNESS_JSON, LOG_NAME, REPO,
                                         RunSpecError, invocation_runs, parse_run_spec, read_json, spec)
from benchmarks.rows import results_dir, run_info
from megatron_fp4.console import quiet_third_party_notices

PROG = "python -m benchmarks.convergence"


def _run_spec(text: str):
    try:
        return parse_run_spec(text)
    except RunSpecError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _add_run_choice(p: argparse.ArgumentParser, default_help: str) -> None:
    p.add_argument("--runs", default=None,
                   help=f"comma-separated run names from: {', '.join(CATALOGUE)} ({default_help})")
    p.add_argument("--run", action="append", default=[], metavar="SPEC", type=_run_spec,
                   help="a run of your own: 'NAME CONFIG SEED [data_seed=N] [FLAGS ...]', CONFIG a name or path "
                        "under configs/convergence/ ('h512/fp4') or a YAML file of your own (repeatable; with --runs, "
                        "in addition to those; alone, the only runs)")
    p.add_argument("--reference-rows", type=Path, default=None, metavar="DIR",
                   help="BF16 references missing among the runs come from the stored rows in this folder (e.g. "
                        "benchmarks/results): the latest BF16 run of the same data order, flags, iterations, "
                        "validation set and corpus; so a call can train candidate runs only")
    p.add_argument("--plot", type=Path, default=None, metavar="PNG",
                   help="also draw every run that logged a training loss, from the logs, into this file")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = p.add_subparsers(dest="mode", required=True, metavar="MODE")
    train = modes.add_parser("train", help="train the runs side by side, then write the summary, rows and plot")
    _add_run_choice(train, f"default, when no --run is given either: {','.join(DEFAULT_RUNS)}")
    train.add_argument("--iters", type=int, default=harness.DEFAULT_ITERS,
                       help="training iterations per run (default %(default)s)")
    train.add_argument("--corpus", type=Path, default=harness.DEFAULT_CORPUS,
                       help="corpus prefix; built from this machine's Python sources when missing (default %(default)s)")
    train.add_argument("--out-dir", type=Path, default=None, help="run directories (default runs/convergence_<time>)")
    train.add_argument("--budget-s", type=float, default=480.0,
                       help="wall-clock seconds for the runs, after which the rest are stopped (default %(default)s); "
                            f"under an outer time limit, keep it {harness.WRITE_MARGIN_S} s below what is left of that "
                            "limit when the runs start: stopping them and writing the rows takes up to that")
    train.add_argument("--poll-s", type=float, default=10.0, help="seconds between progress lines (default %(default)s)")
    train.add_argument("--dry-run", action="store_true", help="check the runs and print their commands, start nothing")
    logs = modes.add_parser("from-logs", help="start nothing: the summary, rows and plot of an out dir's logs")
    logs.add_argument("dir", type=Path, metavar="DIR", help="an out dir of train: DIR/<run>/train_node0.log")
    _add_run_choice(logs, "default: the runs of DIR's harness.json")
    logs.add_argument("--iters", type=int, default=None,
                      help="the iterations the runs were asked for (default DIR's harness.json's, else the logs')")
    logs.add_argument("--corpus", type=Path, default=None,
                      help="the corpus the logs trained on, when it exists here (default DIR/corpus.json)")
    logs.add_argument("--reference-from", type=Path, default=None, metavar="DIR2",
                      help="BF16 references missing among the runs come from this out dir of another invocation on "
                           "the same corpus and validation set")
    logs.add_argument("--gpu", default=None, help="when DIR has no harness.json: the GPU the logs were trained on")
    table = modes.add_parser("seeds", help="each setting's deviations from BF16 by seed, and their means, from rows",
                             description=seeds.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    table.add_argument("--results", type=Path, default=Path("benchmarks/results"),
                       help="folder of convergence.jsonl (and convergence_curves.jsonl, for the training deviations)")
    table.add_argument("--configs", nargs="+", default=["fp8.yaml", "fp4.yaml"],
                       help="settings: config file names, each optionally followed by its runs' flags as the runs "
                            "spelled them (one quoted argument: 'h512/fp4.yaml --moe-fp4-storage experts')")
    table.add_argument("--iters", type=int, default=2000)
    drawing = modes.add_parser("plot", help="plot one harness run's stored rows", description=plot.__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    drawing.add_argument("--results", type=Path, default=None, help="folder of the .jsonl rows (default: the rows' folder)")
    drawing.add_argument("--run", default=None, help="the harness run's `run` field (default: the latest)")
    drawing.add_argument("--out", type=Path, default=plot.DEFAULT_OUT, help="PNG to write (default %(default)s)")
    return p


def parse_args(argv):
    p = parser()
    args = p.parse_args(argv)
    if args.mode not in ("train", "from-logs"):
        return args
    if args.mode == "from-logs" and args.runs is None and (args.dir / HARNESS_JSON).exists():
        try:
            args.selected = invocation_runs(args.dir) + args.run
        except RunSpecError as error:
            p.error(f"{args.dir / HARNESS_JSON}: {error}")
    else:
        # --run alone names every run: a call of one's own runs must not start the default set too.
        default = "" if args.run or args.mode == "from-logs" else ",".join(DEFAULT_RUNS)
        names = [n for n in (default if args.runs is None else args.runs).split(",") if n]
        unknown = [n for n in names if n not in CATALOGUE]
        if unknown:
            p.error(f"unknown run(s) {', '.join(unknown)}; known: {', '.join(CATALOGUE)}")
        args.selected = [CATALOGUE[n] for n in names] + args.run
    if not args.selected:
        p.error("no runs: give --runs or --run")
    if len({r.name for r in args.selected}) != len(args.selected):
        p.error("two runs share a name")
    return args


def from_logs(args) -> int:
    """from-logs DIR: the summary and rows of DIR's logs, as after a real run, launching nothing."""
    log_dir, runs = args.dir.resolve(), args.selected
    missing = [run.name for run in runs if not (log_dir / run.name / LOG_NAME).exists()]
    if missing:
        raise SystemExit(f"error: {log_dir} has no log of run(s) {', '.join(missing)} (<run>/{LOG_NAME}); "
                         "name the runs it holds with --runs.")
    recorded, copied = read_json(log_dir / HARNESS_JSON), read_json(log_dir / CORPUS_JSON)
    if args.corpus is not None and Path(f"{args.corpus.resolve()}.idx").exists():
        record = harness.corpus_record(args.corpus.resolve(), runs)
        if copied is not None and copied["sha256"] != record["sha256"]:
            raise SystemExit(f"error: the logs in {log_dir} trained on corpus sha256 {copied['sha256'][:16]} "
                             f"({CORPUS_JSON}), not on {args.corpus} (sha256 {record['sha256'][:16]}).")
    elif copied is not None:
        record = copied
    else:
        raise SystemExit(f"error: no corpus record for the logs in {log_dir}: give --corpus, the prefix of the existing "
                         f"corpus they trained on, or put its record in {log_dir / CORPUS_JSON}.")
    logs = {run.name: read_log(log_dir / run.name) for run in runs}
    totals = {log.total_iterations for log in logs.values() if log.total_iterations}
    iters = args.iters or (recorded or {}).get("iters") or (totals.pop() if len(totals) == 1 else None)
    if iters is None:
        raise SystemExit(f"error: the logs in {log_dir} do not agree on the iterations asked; give --iters.")
    corpus_info = harness.check_less_than_one_epoch(runs, iters, record)
    if recorded is not None:
        info = dict(recorded["info"])
    elif args.gpu:
        info = {"gpu": args.gpu, "gpus": 1, "torch": "unknown", "python": "unknown",
                "date": time.strftime("%Y-%m-%d", time.gmtime()), "run": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    else:
        raise SystemExit(f"error: {log_dir} has no {HARNESS_JSON} to say which GPU trained the runs; give --gpu NAME.")
    commit = os.environ.get("MEGATRON_FP4_COMMIT") or info.get("commit")
    if not commit:
        raise SystemExit(f"error: which commit trained the runs in {log_dir}? Set MEGATRON_FP4_COMMIT.")
    info["commit"] = commit
    status = {run.name: f"re-read from {log_dir}" for run in runs}
    concurrent = len(recorded["runs"]) if recorded is not None else None
    report(runs, log_dir, status, iters, corpus_info, info, args.reference_from and args.reference_from.resolve(),
           concurrent, args.reference_rows, args.plot)
    return 0


def train(args) -> int:
    """train: the runs side by side, then the summary, rows and plot."""
    runs, iters, corpus = args.selected, args.iters, args.corpus.resolve()
    if not Path(f"{corpus}.idx").exists():
        from megatron_fp4.corpus import build_corpus

        print(f"building the corpus {corpus} ...", flush=True)
        build_corpus(corpus, overwrite=True)  # no index: what is there is an unfinished build
    record = harness.corpus_record(corpus, runs)
    corpus_info = harness.check_less_than_one_epoch(runs, iters, record)
    for run in runs:
        sizes = corpus_info["sizes"][run.name]
        print(f"{run.name}: {sizes['tokens_per_iteration']} tokens/iteration, {sizes['tokens_per_run']} per run, "
              f"{sizes['tokens_per_run'] / sizes['train_split_tokens']:.2f} epochs of the train split")
    out_dir = (args.out_dir or REPO / "runs" / time.strftime("convergence_%Y%m%d_%H%M%S")).resolve()
    if args.dry_run:
        return harness.dry_run(runs, iters, corpus, out_dir)
    info = run_info(gpus=1)  # the rows' GPU, versions, commit and start time, also for from-logs later
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / CORPUS_JSON).write_text(json.dumps(record, indent=1) + "\n")
    (out_dir / HARNESS_JSON).write_text(json.dumps(
        {"info": info, "iters": iters, "budget_s": args.budget_s, "runs": [spec(run) for run in runs]}, indent=1) + "\n")
    with harness.Signals() as signals:  # from here a SIGTERM or SIGINT still ends with the rows written
        status = harness.run_all(runs, iters, corpus, out_dir, args.budget_s, args.poll_s, signals)
        report(runs, out_dir, status, iters, corpus_info, info, reference_rows=args.reference_rows, plot_to=args.plot)
    if signals.received is not None:
        print(f"{signals.name}: the runs were stopped; the rows hold what their logs held", flush=True)
        return 128 + signals.received
    return 0 if all(s.startswith("finished") for s in status.values()) else 1


def main(argv=None) -> int:
    quiet_third_party_notices()  # before Megatron is imported
    args = parse_args(argv)
    if args.mode == "seeds":
        return seeds.print_tables(args.results, args.configs, args.iters)
    if args.mode == "plot":
        print(f"wrote {plot.plot_rows(args.results or results_dir(), args.run, args.out)}")
        return 0
    from megatron_fp4.run_config import ConfigError

    try:
        return train(args) if args.mode == "train" else from_logs(args)
    except (ConfigError, RunSpecError) as error:  # a config that does not load: one sentence, no traceback
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
