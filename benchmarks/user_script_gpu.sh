#!/usr/bin/env bash
# A Megatron-LM training script with megatron_fp4's documented lines (tests/support/integration_lines.py
# applies them as a user would), trained on one GPU with torchrun: the 0.19 stand-in
# (tests/data/megatron_lm_0_19) and, when UPSTREAM names a folder holding upstream Megatron-LM's own
# pretrain_gpt.py, gpt_builders.py and model_provider.py of core_v0.19.0, that script too. The model
# and flags are configs/proxy/gpus1_fp4_fp8.yaml's (FP4 dispatch, FP8 experts) with --moe-fp4-telemetry,
# TRAIN_ITERS (50) iterations. Prints, per script, its exit status, the census line, the last two
# iteration lines (loss and telemetry) and any error line; the logs go to LOG_DIR (a temporary folder).
#
#   [UPSTREAM=folder] [TRAIN_ITERS=50] [LOG_DIR=folder] benchmarks/user_script_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/device_setup.sh
ITERS=${TRAIN_ITERS:-50}
LOGS=${LOG_DIR:-$(mktemp -d)}
WORK=$(mktemp -d)
mkdir -p "$LOGS"
ARGV=$(python3 -m megatron_fp4.cli argv configs/proxy/gpus1_fp4_fp8.yaml) || exit 2

train() {  # train NAME RELEASE SOURCE_FOLDER
    local name=$1 start=$SECONDS
    python3 tests/support/integration_lines.py "$2" "$3" "$WORK/$name/$2" || return
    # eval: the config's argv quotes values such as --moe-layer-freq '[0]+[1]*5'
    eval torchrun --nproc-per-node 1 "$WORK/$name/$2/pretrain_gpt.py" "$ARGV" --train-iters "$ITERS" \
        --moe-fp4-telemetry --log-interval 10 --eval-iters 0 --eval-interval 1000000 >"$LOGS/$name.log" 2>&1
    echo "=== $name: exit $? in $((SECONDS - start)) s"
    grep -E "^megatron_fp4:|^error:|megatron-core version|Megatron-Core version" "$LOGS/$name.log"
    grep " iteration " "$LOGS/$name.log" | tail -2
}

train stand_in_0_19 0.19 tests/data/megatron_lm_0_19
if [[ -n ${UPSTREAM:-} ]]; then
    train upstream_0_19 0.19 "$UPSTREAM"
fi
