#!/usr/bin/env bash
# Proxy pretraining run: a small DeepSeek-V3-like MoE GPT (configs/proxy/base.yaml: 6 layers, the
# first dense; 16 routed experts top-4, sigmoid router with expert bias, one shared expert, one MTP
# layer; mock data; Megatron's local layers) on N GPUs of this machine with expert parallelism N,
# through scripts/launch.py and configs/proxy/gpus<N>.yaml.
#
#   scripts/train_proxy.sh [N] [extra launcher flags...]
#
# N: 1, 2, 4 or 8 GPUs (first argument, else $NPROC, else the visible GPUs). Extra flags go after
# the config's, so they win (e.g. --train-iters 50, --moe-fp4-dispatch-grad fp8).
# Environment: FP4=0 runs stock Megatron (no --moe-fp4-dispatch); TRAIN_ITERS, MBS, GBS override
# the config; RUN_NAME names the run directory runs/<RUN_NAME> (command, log, checkpoint; a
# directory that already holds a checkpoint is resumed from it, as Megatron does with --load);
# DRY_RUN=1 prints the command only; TORCHRUN (torchrun), PYTHON (python3).
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then
    N=$1
    shift
elif [[ -n ${NPROC:-} ]]; then
    N=$NPROC
elif [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
    N=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .)
else
    N=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | grep -c . || true)
fi
CONFIG=configs/proxy/gpus$N.yaml
if [[ ! -f $CONFIG ]]; then
    echo "error: no proxy config for $N GPU(s); there are: $(ls configs/proxy/gpus*.yaml | tr '\n' ' ')" >&2
    exit 2
fi

FLAGS=()
[[ ${FP4:-1} == 0 ]] || FLAGS+=(--moe-fp4-dispatch)
[[ -z ${TRAIN_ITERS:-} ]] || FLAGS+=(--train-iters "$TRAIN_ITERS")
[[ -z ${MBS:-} ]] || FLAGS+=(--micro-batch-size "$MBS")
[[ -z ${GBS:-} ]] || FLAGS+=(--global-batch-size "$GBS")
[[ ${DRY_RUN:-0} == 0 ]] || FLAGS+=(--dry-run)
MODE=$([[ ${FP4:-1} == 0 ]] && echo bf16 || echo fp4)
export RUN_DIR=runs/${RUN_NAME:-proxy_${MODE}_n${N}_$(date +%Y%m%d_%H%M%S)}

exec "${PYTHON:-python3}" scripts/launch.py "$CONFIG" "${FLAGS[@]}" "$@"
