#!/usr/bin/env bash
# Proxy pretraining run: a small DeepSeek-V3-like MoE GPT (configs/proxy/base.yaml: 6 layers, the
# first dense; 16 routed experts top-4, sigmoid router with expert bias, one shared expert, one MTP
# layer; mock data; Megatron's local layers) on N GPUs of this machine with expert parallelism N,
# through scripts/launch.py and configs/proxy/gpus<N>_<PRECISION>.yaml.
#
#   scripts/train_proxy.sh [N] [extra launcher flags...]
#
# N: 1, 2, 4 or 8 GPUs (first argument, else $NPROC, else the visible GPUs: CUDA_VISIBLE_DEVICES,
# else nvidia-smi's list); it prints the config it chose in one line. Extra flags go after the
# config's, so they win (e.g. --train-iters 50, --moe-fp4-dispatch-grad fp8).
# Environment: PRECISION picks the config: fp4 (the default: MXFP4 dispatch, Megatron's BF16
# experts), fp4_fp8 (MXFP4 dispatch and FP8 experts) or bf16 (stock Megatron; FP4=0 means the
# same). TRAIN_ITERS, MBS, GBS override the config; RUN_NAME names the run directory
# runs/<RUN_NAME> (command, log, checkpoint; a directory that already holds a checkpoint is resumed
# from it, as Megatron does with --load), else the launcher makes a new one (runs/<config>_<time>);
# DRY_RUN=1 prints the command only, on any machine (give N where there are no GPUs);
# PYTHON: the interpreter (default: this checkout's .venv/bin/python, else python3); TORCHRUN
# replaces that interpreter's torchrun.
# Without N NVIDIA GPUs (nvidia-smi's list), or with a GPU count that has no config (3, 5, ...),
# it stops with one line saying so, exit status 2.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"
    exit 0
fi

gpus_here() {
    nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | grep -c . || true
}

SOURCE=found  # where N came from
if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then
    N=$1 SOURCE=given
    shift
elif [[ -n ${NPROC:-} ]]; then
    N=$NPROC SOURCE=given
elif [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
    N=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .)
else
    N=$(gpus_here)
fi

if [[ ${DRY_RUN:-0} == 0 ]]; then
    FOUND=$(gpus_here)
    if ((FOUND == 0 || FOUND < N)); then
        WANTED=$( [[ $SOURCE == given ]] && echo "$N NVIDIA GPU(s) (" || echo "this machine's NVIDIA GPUs (1, 2, 4 or 8; ")
        echo "error: the proxy run trains on ${WANTED}Hopper: H100 or H200, with the NVIDIA driver) and" \
            "nvidia-smi finds $( ((FOUND > 0)) && echo "$FOUND" || echo none) on this machine;" \
            "DRY_RUN=1 prints its launch command without them." >&2
        exit 2
    fi
elif ((N == 0)); then
    echo "error: DRY_RUN=1 finds no GPUs here to count: give their number, e.g. DRY_RUN=1 scripts/train_proxy.sh 2." >&2
    exit 2
fi

PRECISION=${PRECISION:-$([[ ${FP4:-1} == 0 ]] && echo bf16 || echo fp4)}
CONFIG=configs/proxy/gpus${N}_${PRECISION}.yaml
if [[ ! -f $CONFIG ]]; then
    FITS=0  # the most GPUs of this machine a config of this precision trains on
    for path in configs/proxy/gpus*_"$PRECISION".yaml; do
        n=${path#configs/proxy/gpus}
        n=${n%%_*}
        if [[ $n =~ ^[0-9]+$ ]] && ((n <= N && n > FITS)); then
            FITS=$n
        fi
    done
    if [[ $SOURCE == found ]] && ((FITS > 0)); then
        echo "error: the proxy runs on 1, 2, 4 or 8 GPUs and this machine has $N: scripts/train_proxy.sh $FITS" \
            "trains on $FITS of them." >&2
    else
        echo "error: no proxy config for $N GPU(s) in precision $PRECISION ($CONFIG); there are:" \
            "$(cd configs/proxy && echo gpus*_*.yaml)." >&2
    fi
    exit 2
fi
GPU_WORD=$( ((N == 1)) && echo GPU || echo GPUs)
echo "train_proxy: $N $GPU_WORD ($([[ $SOURCE == given ]] && echo "as asked" || echo "this machine's")): $CONFIG"

FLAGS=()
[[ -z ${TRAIN_ITERS:-} ]] || FLAGS+=(--train-iters "$TRAIN_ITERS")
[[ -z ${MBS:-} ]] || FLAGS+=(--micro-batch-size "$MBS")
[[ -z ${GBS:-} ]] || FLAGS+=(--global-batch-size "$GBS")
[[ ${DRY_RUN:-0} == 0 ]] || FLAGS+=(--dry-run)
if [[ -n ${RUN_NAME:-} ]]; then
    export RUN_DIR=runs/$RUN_NAME
else
    unset RUN_DIR  # the launcher makes a new run directory, never one another launch has
fi

if [[ -z ${PYTHON:-} ]]; then
    PYTHON=$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)
fi
exec "$PYTHON" scripts/launch.py "$CONFIG" "${FLAGS[@]}" "$@"
