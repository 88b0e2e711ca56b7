#!/usr/bin/env bash
# Proxy pretraining run: a small DeepSeek-V3-like MoE GPT (configs/proxy/base.yaml: 6 layers, the
# first dense; 16 routed experts top-4, sigmoid router with expert bias, one shared expert, one MTP
# layer; mock data; Megatron's local layers) on N GPUs of this machine with expert parallelism N,
# through scripts/launch.py and configs/proxy/gpus<N>_<PRECISION>.yaml.
#
#   scripts/train_proxy.sh [N] [extra launcher flags...]
#
# N: 1, 2, 4 or 8 GPUs (first argument, else $NPROC, else the visible GPUs). Extra flags go after
# the config's, so they win (e.g. --train-iters 50, --moe-fp4-dispatch-grad fp8).
# Environment: PRECISION picks the config: fp4 (the default: MXFP4 dispatch, Megatron's BF16
# experts), fp4_fp8 (MXFP4 dispatch and FP8 experts) or bf16 (stock Megatron; FP4=0 means the
# same). TRAIN_ITERS, MBS, GBS override the config; RUN_NAME names the run directory
# runs/<RUN_NAME> (command, log, checkpoint; a directory that already holds a checkpoint is resumed
# from it, as Megatron does with --load); DRY_RUN=1 prints the command only, on any machine;
# PYTHON: the interpreter (default: this checkout's .venv/bin/python, else python3); TORCHRUN
# replaces that interpreter's torchrun.
# Without N NVIDIA GPUs (nvidia-smi's list) it stops with one line saying so, exit status 2.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"
    exit 0
fi

gpus_here() {
    nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | grep -c . || true
}

if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then
    N=$1
    shift
elif [[ -n ${NPROC:-} ]]; then
    N=$NPROC
elif [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
    N=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .)
else
    N=$(gpus_here)
fi

if [[ ${DRY_RUN:-0} == 0 ]]; then
    FOUND=$(gpus_here)
    if ((FOUND == 0 || FOUND < N)); then
        WANTED=$( ((N > 0)) && echo "$N NVIDIA GPU(s)" || echo "NVIDIA GPUs")
        echo "error: the proxy run trains on $WANTED (Hopper: H100 or H200, with the NVIDIA driver) and" \
            "nvidia-smi finds $( ((FOUND > 0)) && echo "$FOUND" || echo none) on this machine;" \
            "DRY_RUN=1 prints its launch command without them." >&2
        exit 2
    fi
fi

PRECISION=${PRECISION:-$([[ ${FP4:-1} == 0 ]] && echo bf16 || echo fp4)}
CONFIG=configs/proxy/gpus${N}_${PRECISION}.yaml
if [[ ! -f $CONFIG ]]; then
    echo "error: no proxy config for $N GPU(s) in precision $PRECISION ($CONFIG); there are:" \
        "$(cd configs/proxy && echo gpus*_*.yaml)." >&2
    exit 2
fi

FLAGS=()
[[ -z ${TRAIN_ITERS:-} ]] || FLAGS+=(--train-iters "$TRAIN_ITERS")
[[ -z ${MBS:-} ]] || FLAGS+=(--micro-batch-size "$MBS")
[[ -z ${GBS:-} ]] || FLAGS+=(--global-batch-size "$GBS")
[[ ${DRY_RUN:-0} == 0 ]] || FLAGS+=(--dry-run)
export RUN_DIR=runs/${RUN_NAME:-proxy_${PRECISION}_n${N}_$(date +%Y%m%d_%H%M%S)}

if [[ -z ${PYTHON:-} ]]; then
    PYTHON=$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)
fi
exec "$PYTHON" scripts/launch.py "$CONFIG" "${FLAGS[@]}" "$@"
