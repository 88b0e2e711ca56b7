#!/usr/bin/env bash
# Proxy pretraining run: a small DeepSeek-V3-like MoE GPT (6 layers, the first dense; 16 routed
# experts, top-4, sigmoid router with expert bias, one shared expert, one MTP layer) on mock data,
# trained by scripts/pretrain_gpt_fp4.py with Megatron's local (no Transformer Engine, no apex)
# layers and the all-to-all dispatcher over expert parallelism.
#
#   scripts/train_proxy.sh [N] [extra launcher flags...]
#
# N: GPUs (first argument, else $NPROC, else the visible GPUs, at least 1). Extra flags go to the
# launcher after ours, so they override ours (e.g. --train-iters 50, --moe-fp4-dispatch-grad fp8).
# Environment: FP4=0 runs stock Megatron (no --moe-fp4-dispatch); TRAIN_ITERS (300), MBS (4),
# GBS (32), EVAL_ITERS (10, one validation at the end), RUN_NAME; TORCHRUN (torchrun).
# The log and the command line go to runs/<RUN_NAME>/.
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
((N >= 1)) || N=1

EXPERTS=16
# Expert parallelism: the largest size <= min(N, 4) that divides both N and the expert count.
EP=1
for ((e = 1; e <= N && e <= 4; e++)); do
    ((N % e == 0 && EXPERTS % e == 0)) && EP=$e
done

FP4=${FP4:-1}
TRAIN_ITERS=${TRAIN_ITERS:-300}
if [[ $FP4 == 0 ]]; then MODE=bf16; else MODE=fp4; fi
RUN_NAME=${RUN_NAME:-proxy_${MODE}_n${N}_$(date +%Y%m%d_%H%M%S)}
RUN_DIR=runs/$RUN_NAME
mkdir -p "$RUN_DIR"

# Recipes' settings; NVLink multicast stays off (it can take a shared host's GPUs down).
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1

MODEL=(
    --num-layers 6 --hidden-size 1024 --ffn-hidden-size 2816 --num-attention-heads 16
    --seq-length 1024 --max-position-embeddings 1024 --position-embedding-type rope
    --normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
    --attention-dropout 0.0 --hidden-dropout 0.0
    --mtp-num-layers 1
)
MOE=(
    --num-experts $EXPERTS --moe-layer-freq "[0]+[1]*5" --moe-ffn-hidden-size 512
    --moe-router-topk 4 --moe-shared-expert-intermediate-size 512
    --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-dtype fp32
    --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4
    --moe-token-dispatcher-type alltoall
)
PARALLEL=(
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
    --expert-model-parallel-size $EP --expert-tensor-parallel-size 1
    --use-distributed-optimizer
)
# No Transformer Engine and no apex: Megatron's local layers, and none of the fusions whose
# kernels come from those packages (fused grad accumulation, masked softmax, persistent layer
# norm, fused RoPE). --moe-grouped-gemm and --moe-permute-fusion would need TE too.
NO_TE=(
    --transformer-impl local --no-gradient-accumulation-fusion --no-masked-softmax-fusion
    --no-persist-layer-norm --no-rope-fusion --no-create-attention-mask-in-dataloader
)
TRAIN=(
    --bf16 --micro-batch-size "${MBS:-4}" --global-batch-size "${GBS:-32}"
    --train-iters "$TRAIN_ITERS" --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine
    --lr-warmup-fraction 0.1 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
    --seed 1234
)
DATA=(--mock-data --tokenizer-type NullTokenizer --vocab-size 32000)
LOGGING=(--log-interval 10 --log-throughput --eval-iters "${EVAL_ITERS:-10}")
FP4_FLAGS=()
[[ $FP4 == 0 ]] || FP4_FLAGS=(--moe-fp4-dispatch)

TORCHRUN=${TORCHRUN:-torchrun}
CMD=($TORCHRUN --standalone --nproc-per-node "$N" scripts/pretrain_gpt_fp4.py
    "${MODEL[@]}" "${MOE[@]}" "${PARALLEL[@]}" "${NO_TE[@]}" "${TRAIN[@]}" "${DATA[@]}" "${LOGGING[@]}"
    "${FP4_FLAGS[@]}" "$@")

echo "train_proxy: $N GPU(s), EP=$EP, FP4 dispatch $([[ $FP4 == 0 ]] && echo off || echo on), log $RUN_DIR/train.log"
printf '%q ' "${CMD[@]}" | tee "$RUN_DIR/command.txt"
echo
"${CMD[@]}" 2>&1 | tee "$RUN_DIR/train.log"
