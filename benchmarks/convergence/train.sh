#!/usr/bin/env bash
# The convergence proxy in one go on a GPU machine: install the megatron-core wheel when it is not
# importable (as gpu_checks.sh does), build the corpus from this machine's Python sources, train the
# runs side by side, write the rows and the plot (`python -m benchmarks.convergence train`; its
# --help lists the runs and options, all of which this script passes on).
#
#   benchmarks/convergence/train.sh                                  # the default runs, 2000 iterations
#   benchmarks/convergence/train.sh --iters 20 --runs bf16,fp4 --budget-s 60    # smoke
# Environment: MEGATRON_FP4_BENCH_RESULTS (rows; default benchmarks/results/), MEGATRON_FP4_COMMIT,
# PLOT (default docs/img/convergence.png), MEGATRON_WHEEL_DIR (.whl).
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
# exec: a SIGTERM to this script (an outer timeout) reaches the harness, which then stops the runs
# and still writes the rows.
exec python3 -m benchmarks.convergence train --plot "${PLOT:-docs/img/convergence.png}" "$@"
