#!/usr/bin/env bash
# Everything this repo checks on GPUs, in one go (a device session is short; about 9 minutes on
# 2 x H200): the GPU-marked tests plus the device-agnostic kernel and FP8-experts tests on CUDA,
# the kernel benchmark at 16384 x 7168, the grouped expert GEMMs, the MoE layer benchmark on one GPU (EP 1:
# the five expert configurations, the torch._grouped_mm peer among them) and over all GPUs (stock vs FP4
# dispatch and the five expert configurations), the recompute-cache benchmark, the telemetry's cost, a per-kernel profile of the FP4 +
# FP8-experts layer, and a proxy training run with FP8 experts through the README's command.
# Prints a short summary. The benchmarks append their rows to benchmarks/results/*.jsonl, or to
# $MEGATRON_FP4_BENCH_RESULTS (on the device machine: a folder under $OUT, so that they come back);
# set MEGATRON_FP4_COMMIT there too (the device copy has no git history).
# (The whole CPU suite also runs on a GPU machine, but takes several minutes more and some of it,
# e.g. the patch tests, downloads from the registry, which the device machines cannot reach.)
#
#   benchmarks/gpu_checks.sh               # on a machine with 1+ GPUs, from anywhere
# Environment: CHECKS (space-separated step names: tests experts_tests bench_kernels bench_quantizers bench_grouped_gemm moe_layer_1gpu
# bench_moe_layer bench_moe_cache bench_telemetry profile_fp4_fp8 profile_cache memcap_capped train_proxy; default all) to split the
# work over two device calls,
# e.g. CHECKS="bench_moe_cache profile_fp4_fp8 train_proxy" TRAIN_ITERS=200; TRAIN_ITERS (60) for the proxy run; BENCH_EXPERTS (16 per 2 GPUs, 32 on 4);
# MEMCAP_CONFIGS (memcap_bf16_attn memcap_fp4_fp8_attn): the configs/proxy/ names run under their cap;
# proxy_memory (benchmarks/bench_proxy_memory.py, the one-GPU memory-cap proxies) and convergence_ep2 (the
# convergence proxy's FP4 recipe at EP 2; CONVERGENCE_BUDGET_S, 420) run only when CHECKS names them;
# MEGATRON_WHEEL_DIR (.whl): megatron-core wheels installed to /tmp/site when not importable.
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/device_setup.sh
GPUS=$(nvidia-smi --query-gpu=index --format=csv,noheader | grep -c .)
nvidia-smi topo -m || true
declare -A STATUS

step() {  # step NAME command...: run, time, remember the exit status (only the names in $CHECKS, if set)
    local name=$1 start=$SECONDS
    shift
    if [[ -n ${CHECKS:-} && " $CHECKS " != *" $name "* ]]; then
        return
    fi
    echo "=== $name: $*"
    "$@"
    STATUS[$name]="exit $? in $((SECONDS - start)) s"
}

step tests python3 -m pytest -q -p no:warnings -rA -s -m gpu tests
step experts_tests python3 -m pytest -q -p no:warnings -s tests/integration/test_fp8_experts.py tests/ops/test_weight_quantizer.py \
    tests/ops/test_swiglu.py tests/ops/test_kernels.py tests/ops/test_grouped_gemm.py
step bench_kernels python3 -m benchmarks.bench_kernels --sizes 16384x7168 --no-baseline
step bench_quantizers python3 -m benchmarks.bench_quantizers
step bench_grouped_gemm python3 -m benchmarks.bench_grouped_gemm
# EP 1 on the first GPU (no torchrun), DeepSeek-V3 layer dimensions, 32 experts (five layers: weights
# and gradients about 28 GB).
step moe_layer_1gpu python3 -m benchmarks.bench_moe_layer --experts 32
if ((GPUS >= 2)); then
    EXPERTS=${BENCH_EXPERTS:-$((8 * GPUS))}
    step bench_moe_layer torchrun --standalone --nproc-per-node "$GPUS" -m benchmarks.bench_moe_layer --experts "$EXPERTS"
    step bench_moe_cache torchrun --standalone --nproc-per-node "$GPUS" -m benchmarks.bench_moe_cache --experts "$EXPERTS"
    step bench_telemetry torchrun --standalone --nproc-per-node "$GPUS" -m benchmarks.bench_telemetry --experts "$EXPERTS"
    step profile_fp4_fp8 torchrun --standalone --nproc-per-node "$GPUS" -m benchmarks.profile_moe_layer \
        --experts "$EXPERTS" --layer stock,fp4-fp8 --host
    # Why the cache saves little with FP8 experts: the checkpointed FP8 layer with and without it.
    step profile_cache torchrun --standalone --nproc-per-node "$GPUS" -m benchmarks.profile_moe_layer \
        --experts "$EXPERTS" --layer fp4-fp8-recompute,fp4-fp8-cache
fi
if ((GPUS == 2)); then
    # The memory-cap proxies under their 14 GiB cap: stock BF16 with attention recompute only is
    # expected to stop with torch.OutOfMemoryError, FP4 dispatch with FP8 experts to train
    # (MEMCAP_CONFIGS adds the others; `megatron-fp4 estimate` says which should fit).
    memcap() {
        local config=$1
        RUN_DIR=runs/capped_$config python3 scripts/launch.py --enforce-memory-cap "configs/proxy/$config.yaml" \
            --train-iters 3 --log-interval 1 --eval-iters 0 --no-save-optim --no-save-rng >"runs/capped_$config.log" 2>&1
        echo "$config: exit $?"
        grep -E "capping|max allocated|OutOfMemoryError: CUDA" "runs/capped_$config.log" | cut -c1-240 | sed -n '1p;$p'
    }
    mkdir -p runs
    MEMCAP_CONFIGS=${MEMCAP_CONFIGS:-memcap_bf16_attn memcap_fp4_fp8_attn}
    step memcap_capped bash -c "$(declare -f memcap); for c in $MEMCAP_CONFIGS; do memcap \$c; done"
fi
# The one-GPU memory-cap proxies (configs/proxy/memcap1_*.yaml, about 5 minutes): only when CHECKS names
# proxy_memory.
if [[ " ${CHECKS:-} " == *" proxy_memory "* ]]; then
    step proxy_memory python3 -m benchmarks.bench_proxy_memory
fi
# The convergence proxy's whole FP4 recipe at expert parallelism 2 (configs/convergence/fp4_ep2.yaml,
# 2000 iterations, a few minutes) beside the same recipe on one GPU (fp4), both against the stored
# one-GPU BF16 run of seed 1234: only when CHECKS names convergence_ep2, on 2+ GPUs.
if ((GPUS >= 2)) && [[ " ${CHECKS:-} " == *" convergence_ep2 "* ]]; then
    step convergence_ep2 env PLOT=runs/convergence_ep2.png bash benchmarks/convergence/train.sh --runs fp4 \
        --run "fp4_ep2 fp4_ep2 1234" --reference-rows benchmarks/results --budget-s "${CONVERGENCE_BUDGET_S:-420}"
fi
step train_proxy env TRAIN_ITERS="${TRAIN_ITERS:-60}" RUN_NAME=proxy_fp4 bash scripts/train_proxy.sh "$GPUS" \
    --moe-fp4-experts fp8
# First and last logged iterations (lm loss), and Megatron's count of NaN iterations over the run.
if [[ -n ${STATUS[train_proxy]:-} ]]; then
    grep -E "iteration +[0-9]+/" runs/proxy_fp4/train_node0.log | sed -n '1p;$p'
    grep -oE "number of nan iterations: +[0-9]+" runs/proxy_fp4/train_node0.log |
        awk '{s += $NF} END {print "nan iterations:", s + 0}'
fi

echo "=== summary"
for name in "${!STATUS[@]}"; do echo "$name: ${STATUS[$name]}"; done
