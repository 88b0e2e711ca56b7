#!/usr/bin/env python3
"""The recompute cache (--moe-fp4-cache) on a checkpointed MoE layer, in one torchrun job; rank 0
appends the results to benchmarks/results/bench_moe_cache.jsonl.

    torchrun --nproc-per-node 2 -m benchmarks.bench_moe_cache --experts 16
    torchrun --nproc-per-node 4 -m benchmarks.bench_moe_cache               # 32 experts over EP 4

DeepSeek-V3 layer dimensions by default, FP4 dispatch, Megatron's BF16 experts and our FP8 experts
(--expert-kinds). Layers per kind: no recompute; recompute_modules ["moe"] with the cache off; with
it on. Measured: forward+backward time (slowest rank's median), bytes the layer holds between
forward and backward (allocated after forward minus before, output included), the cache's own
bytes against the BF16 bytes of the dispatched tokens, and the step time the cache saves against
the forward all-to-all alone and against the whole forward FP4 dispatch as each kind's layer runs
it. The three layers of a kind are timed in turns (interleaved_times_ms); the saving is the median
of the per-round differences, with its quartiles. Every kind's layers start from the same seed
(same router, same routing).
"""

import statistics
import sys

import torch
import torch.distributed as dist

from benchmarks.common import (finish, interleaved_times_ms, layer_options, layer_step, max_over_ranks, moe_config,
                               paired_differences_ms, permuted_tokens_and_splits, random_tokens, slowest_median_ms,
                               start_expert_parallel)

BENCH = "bench_moe_cache"
NO_RECOMPUTE, CACHE_OFF, CACHE_ON = "no recompute", "recompute moe, cache off", "recompute moe, cache on"


def held_bytes(layer, x, grad):
    """Bytes allocated by the forward and kept until backward (then runs the backward)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    inp = x.detach().requires_grad_(True)
    out, _ = layer(inp)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    dispatcher = layer.token_dispatcher
    cache_bytes = dispatcher.recompute_cache.nbytes() if dispatcher.recompute_cache is not None else 0
    out.backward(grad)
    return held, cache_bytes


def parse(argv):
    args = layer_options(__doc__)
    args.add_argument("--expert-kinds", default="bf16,fp8",
                      help="comma-separated experts behind the FP4 dispatch: bf16 (Megatron's SequentialMLP, "
                           "the replay dequantizes for them) and/or fp8 (ours, read the payload: no dequantization)")
    args = args.parse_args(argv)
    args.expert_kinds = args.expert_kinds.split(",")
    unknown = set(args.expert_kinds) - {"bf16", "fp8"}
    if unknown:
        raise SystemExit(f"--expert-kinds: unknown {sorted(unknown)}; choose from bf16, fp8")
    return args


def measure_kind(args, experts: str, x, grad, group):
    """Rows no recompute / cache off / cache on for one kind of experts, and the forward dispatch
    alone as that layer runs it (dequantized for BF16 experts, not for FP8 experts)."""
    from megatron_fp4.dispatch import fp4_dispatch_all_to_all
    from megatron_fp4.options import FP4Options
    from megatron_fp4.dispatch.all_to_all import all_to_all_rows
    from megatron_fp4.integration.standalone import build_moe_layer
    from megatron_fp4.kernels import quantize_mxfp4

    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    # The same router and expert weights for every kind of experts: the same routing and splits.
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    world = dist.get_world_size()
    plain = moe_config(args, world)
    checkpointed = moe_config(args, world, recompute_granularity="selective", recompute_modules=["moe"])
    options = FP4Options(dispatch=True, dispatch_grad=args.grad, experts=experts)
    cached = FP4Options(dispatch=True, dispatch_grad=args.grad, cache=True, experts=experts)
    layers = {
        NO_RECOMPUTE: build_moe_layer(plain, options).cuda(),
        CACHE_OFF: build_moe_layer(checkpointed, options).cuda(),
        CACHE_ON: build_moe_layer(checkpointed, cached).cuda(),
    }
    reference = layers[NO_RECOMPUTE].state_dict()
    for layer in layers.values():
        layer.load_state_dict(reference)
    tokens, output_splits, input_splits = permuted_tokens_and_splits(layers[NO_RECOMPUTE], x)
    dequantize = experts == "bf16"
    dispatch_ms = slowest_median_ms(
        lambda: fp4_dispatch_all_to_all(tokens, output_splits, input_splits, group, dequantize=dequantize),
        args.iters, args.warmup)
    wire_rows = quantize_mxfp4(tokens).rows
    all_to_all_ms = slowest_median_ms(lambda: all_to_all_rows(wire_rows, output_splits, input_splits, group),
                                      args.iters, args.warmup)
    received_bf16_bytes = max_over_ranks(sum(output_splits) * args.hidden * 2)
    # In turns: the cache's saving (~0.5 ms of ~32) is below the drift between separate runs.
    times = interleaved_times_ms({name: layer_step(layer, x, grad) for name, layer in layers.items()},
                                 args.iters, args.warmup)
    rows = {}
    for name, layer in layers.items():
        held, cache_bytes = held_bytes(layer, x, grad)
        rows[name] = (max_over_ranks(statistics.median(times[name])), max_over_ranks(held), max_over_ranks(cache_bytes))
    saving = paired_differences_ms(times[CACHE_OFF], times[CACHE_ON])  # what the cache saves, round by round
    del layers
    torch.cuda.empty_cache()
    return rows, saving, (all_to_all_ms, dispatch_ms), received_bf16_bytes


def main(argv=None) -> int:
    args = parse(argv)
    from megatron.core import parallel_state

    rank, world, log, recorder = start_expert_parallel(args, BENCH,
                                                       f"FP4 dispatch, experts {', '.join(args.expert_kinds)}")
    x, grad = random_tokens(args, rank)
    group = parallel_state.get_expert_model_parallel_group()

    log("\n| experts | MoE layer | forward+backward (ms) | held forward->backward (MiB) | cache (MiB) | cache / BF16 dispatched |")
    log("| --- | --- | ---: | ---: | ---: | ---: |")
    summaries = []
    for experts in args.expert_kinds:
        rows, saving, (all_to_all_ms, dispatch_ms), received_bf16_bytes = measure_kind(args, experts, x, grad, group)
        for name, (ms, held, cache_bytes) in rows.items():
            log(f"| {experts} | {name} | {ms:.3f} | {held / 2**20:.1f} | {cache_bytes / 2**20:.1f} | "
                f"{cache_bytes / received_bf16_bytes:.1%} |")
        saved, saved_q1, saved_q3 = saving
        kind = f"{experts} experts"
        recorder.add(f"{kind}, {CACHE_ON}", "layer forward+backward", rows[CACHE_ON][0], "ms",
                     CACHE_OFF, rows[CACHE_OFF][0])
        recorder.add(f"{kind}, {CACHE_OFF}", "layer forward+backward", rows[CACHE_OFF][0], "ms",
                     NO_RECOMPUTE, rows[NO_RECOMPUTE][0])
        recorder.add(f"{kind}, {CACHE_ON}", "cache bytes", rows[CACHE_ON][2] / 2**20, "MiB",
                     "BF16 bytes of the dispatched tokens", received_bf16_bytes / 2**20)
        recorder.add(f"{kind}, {CACHE_ON}", "held for backward", rows[CACHE_ON][1] / 2**20, "MiB",
                     NO_RECOMPUTE, rows[NO_RECOMPUTE][1] / 2**20)
        # The saving is paired round by round: its reference is the forward work the cache skips.
        recorder.add(kind, "step time saved by the cache", saved, "ms", "forward all-to-all of the MXFP4 rows",
                     all_to_all_ms, better="higher", saved_quartiles=[saved_q1, saved_q3])
        recorder.add(kind, "step time saved by the cache", saved, "ms", "whole forward FP4 dispatch", dispatch_ms,
                     better="higher", saved_quartiles=[saved_q1, saved_q3])
        summaries.append(
            f"{kind}: forward dispatch all-to-all alone (MXFP4 rows) {all_to_all_ms:.3f} ms; whole forward "
            f"FP4 dispatch {dispatch_ms:.3f} ms (quantize + all-to-all{' + dequantize' if experts == 'bf16' else ''}); "
            f"BF16 bytes of the dispatched tokens {received_bf16_bytes / 2**20:.1f} MiB (max over ranks).\n"
            f"  The cache saves {saved:.3f} ms (median of per-round differences; quartiles {saved_q1:.3f} / "
            f"{saved_q3:.3f}): {saved / all_to_all_ms:.0%} of the all-to-all, {saved / dispatch_ms:.0%} of the "
            f"whole dispatch; it holds {rows[CACHE_ON][2] / received_bf16_bytes:.1%} of the BF16 bytes")
    log("")
    for line in summaries:
        log(line)
    finish(rank, recorder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
