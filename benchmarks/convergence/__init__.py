"""The convergence proxy's tooling (docs/convergence.md), one entry point with four modes:
`python -m benchmarks.convergence train | from-logs | seeds | plot` (__main__.py; `--help` on each).

    runs.py        the runs: the catalogue, run specs and their configs, which BF16 run each is compared with
    harness.py     training them side by side: corpus and epoch check, launches, budget, signals
    log.py         what a run's training log says
    references.py  each run's BF16 reference, also from another out dir or from stored rows
    report.py      the summary, the rows (benchmarks/results/convergence*.jsonl) and the plot of a call
    seeds.py       each setting's deviations by seed and their means, from the rows
    plot.py        the plot
    train.sh       `train` on a GPU machine in one go (installs the megatron-core wheel when needed)
"""
