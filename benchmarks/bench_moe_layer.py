#!/usr/bin/env python3
"""Stock alltoall MoE layer vs the FP4-dispatch MoE layer, and four expert configurations, in one
torchrun job; rank 0 appends the results to benchmarks/results/bench_moe_layer.jsonl.

    torchrun --nproc-per-node 4 -m benchmarks.bench_moe_layer                 # 32 experts over EP 4
    torchrun --nproc-per-node 2 -m benchmarks.bench_moe_layer --experts 16    # 16 experts over EP 2

DeepSeek-V3 layer dimensions by default (hidden 7168, expert FFN 2048, SwiGLU, top-8, 4096 tokens
per GPU, Megatron's BF16 SequentialMLP experts, no shared expert). Both layers get the same
weights, the same random tokens and the same routing. Printed on rank 0:
- dispatch bytes per rank: every token row the dispatch all-to-all carries (self included);
- dispatch phase: quantize + all-to-all + dequantize (FP4) vs the BF16 all-to-all alone, forward,
  on the real permuted tokens and splits of this routing, and each FP4 part timed alone;
- layer forward+backward time and peak memory of each layer.
Then four layers: stock BF16; the FP8 baseline (our FP8 experts behind the BF16 dispatch,
keeping BF16 activations); FP4 dispatch + Megatron's BF16 experts; FP4 dispatch + FP8 experts.
Columns: forward+backward time, the experts' GEMM TFLOP/s (18 x hidden x FFN FLOPs per routed token
over the layer time) against an FP8 blockwise GEMM ceiling measured in the same run, bytes the layer
holds between forward and backward (allocated after forward minus before; includes the 2-byte
output), and peak memory.
Times are medians over --iters after --warmup, the slowest rank's median (CUDA events).
"""

import sys

import torch

from benchmarks.common import (finish, interleaved_medians_ms, layer_options, layer_step, max_over_ranks, moe_config,
                               peak_memory_gib, permuted_tokens_and_splits, random_tokens, slowest_median_ms,
                               start_expert_parallel)

BENCH = "bench_moe_layer"


def parse_args(argv):
    p = layer_options(__doc__)
    p.add_argument("--no-experts-table", action="store_true", help="skip the four-layer experts comparison")
    return p.parse_args(argv)


def held_for_backward_mib(layer, x, grad) -> float:
    """Bytes allocated by the forward and still held when backward starts (max over ranks)."""
    inp = x.detach().requires_grad_(True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out, _ = layer(inp)
    torch.cuda.synchronize()
    held = (torch.cuda.memory_allocated() - before) / 2**20
    out.backward(grad)
    del out
    return max_over_ranks(held)


def fp8_gemm_ceiling_tflops(args) -> float:
    """TFLOP/s of one large FP8 GEMM with the experts' scaling (1x128 activations, 128x128 weights),
    shaped like fc1 with 16384 tokens, random data."""
    import megatron_fp4 as mf
    from megatron_fp4.experts.gemm import gemm_by_weight, rows_segment

    m, k, n = 16384, args.hidden, 2 * args.ffn
    a = mf.quantize_fp8_rows(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    w = mf.quantize_fp8_weight(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
    operand = rows_segment(a, 0, m)
    ms = slowest_median_ms(lambda: gemm_by_weight(*operand, w), args.iters, args.warmup)
    return 2 * m * k * n / ms / 1e9


STOCK = "stock BF16 (BF16 dispatch, Megatron's experts)"
FP8_BASELINE = "FP8 baseline (BF16 dispatch, our FP8 experts)"
FP4_BF16 = "FP4 dispatch + BF16 experts"
FP4_FP8 = "FP4 dispatch + FP8 experts"


def compare_experts(args, config, x, grad, stock, fp4, log, recorder) -> None:
    """The four layers, from one run, timed in turns (interleaved_medians_ms)."""
    from megatron_fp4.integration.standalone import build_moe_layer
    from megatron_fp4.options import FP4Options

    baseline = build_moe_layer(config, FP4Options(experts="fp8")).cuda()
    fp4_fp8 = build_moe_layer(config, FP4Options(dispatch=True, dispatch_grad=args.grad, experts="fp8")).cuda()
    baseline.load_state_dict(stock.state_dict())
    fp4_fp8.load_state_dict(stock.state_dict())
    layers = {STOCK: stock, FP8_BASELINE: baseline, FP4_BF16: fp4, FP4_FP8: fp4_fp8}
    ceiling = fp8_gemm_ceiling_tflops(args)
    gemm_flops = args.tokens * args.topk * 18 * args.hidden * args.ffn  # rows the experts see, on average
    times = interleaved_medians_ms({name: layer_step(layer, x, grad) for name, layer in layers.items()},
                                   args.iters, args.warmup)
    rows = {}
    for name, layer in layers.items():
        rows[name] = (times[name], held_for_backward_mib(layer, x, grad), peak_memory_gib(layer_step(layer, x, grad)))
    log(f"\nFP8 GEMM ceiling (1x128 x 128x128 scaled_mm, 16384 x {args.hidden} x {2 * args.ffn}): {ceiling:.0f} TFLOP/s")
    log("| MoE layer | forward+backward (ms) | GEMM TFLOP/s (of FP8 ceiling) | held for backward (MiB) | peak (GiB) |")
    log("| --- | ---: | ---: | ---: | ---: |")
    stock_ms, stock_held, stock_peak = rows[STOCK]
    ceiling_name = f"FP8 blockwise scaled_mm 16384 x {args.hidden} x {2 * args.ffn}"
    for name, (ms, held, peak) in rows.items():
        tflops = gemm_flops / ms / 1e9
        log(f"| {name} | {ms:.3f} | {tflops:.0f} ({tflops / ceiling:.0%}) | {held:.1f} | {peak:.2f} |")
        recorder.add(name, "layer forward+backward", ms, "ms", STOCK, stock_ms)
        recorder.add(name, "experts GEMM rate over the layer time", tflops, "TFLOP/s", ceiling_name, ceiling)
        recorder.add(name, "held for backward", held, "MiB", STOCK, stock_held)
        recorder.add(name, "peak memory", peak, "GiB", STOCK, stock_peak)
    base_ms, base_held, _ = rows[FP8_BASELINE]
    ours_ms, ours_held, _ = rows[FP4_FP8]
    recorder.add(FP4_FP8, "layer forward+backward", ours_ms, "ms", FP8_BASELINE, base_ms)
    recorder.add(FP4_FP8, "held for backward", ours_held, "MiB", FP8_BASELINE, base_held)
    log(f"FP4 + FP8 vs the FP8 baseline: {ours_ms / base_ms:.3f}x time, {ours_held / base_held:.1%} held; "
        f"vs stock BF16: {stock_ms / ours_ms:.2f}x faster, {ours_held / stock_held:.1%} held")


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import all_to_all

    import megatron_fp4 as mf
    from megatron_fp4.dispatch import fp4_dispatch_all_to_all
    from megatron_fp4.options import FP4Options
    from megatron_fp4.formats import mxfp4_wire_bytes_per_row
    from megatron_fp4.integration.standalone import build_moe_layer
    from megatron_fp4.tensors import MXFP4Tensor

    rank, world, log, recorder = start_expert_parallel(args, BENCH, f"FP4 gradient {args.grad}")

    config = moe_config(args, world)
    stock = build_moe_layer(config).cuda()
    fp4 = build_moe_layer(config, FP4Options(dispatch=True, dispatch_grad=args.grad)).cuda()
    fp4.load_state_dict(stock.state_dict())
    x, grad = random_tokens(args, rank)

    # Dispatch phase alone, on the permuted tokens and splits of this routing.
    tokens, output_splits, input_splits = permuted_tokens_and_splits(stock, x)
    group = parallel_state.get_expert_model_parallel_group()
    bf16_ms = slowest_median_ms(lambda: all_to_all(group, tokens, output_splits, input_splits), args.iters, args.warmup)
    fp4_ms = slowest_median_ms(lambda: fp4_dispatch_all_to_all(tokens, output_splits, input_splits, group),
                               args.iters, args.warmup)
    # Its three parts, to see where the time goes.
    sent = mf.quantize_mxfp4(tokens)
    received = MXFP4Tensor(all_to_all(group, sent.rows, output_splits, input_splits), args.hidden)
    parts_ms = {
        "quantize": slowest_median_ms(lambda: mf.quantize_mxfp4(tokens), args.iters, args.warmup),
        "all-to-all of MXFP4 rows": slowest_median_ms(
            lambda: all_to_all(group, sent.rows, output_splits, input_splits), args.iters, args.warmup),
        "dequantize": slowest_median_ms(lambda: mf.dequantize_mxfp4(received), args.iters, args.warmup),
    }
    rows = int(max_over_ranks(sum(input_splits)))
    bf16_bytes, fp4_bytes = rows * args.hidden * 2, rows * mxfp4_wire_bytes_per_row(args.hidden)

    # The whole layer, forward + backward.
    stock_ms = slowest_median_ms(layer_step(stock, x, grad), args.iters, args.warmup)
    fp4_layer_ms = slowest_median_ms(layer_step(fp4, x, grad), args.iters, args.warmup)
    stock_peak, fp4_peak = peak_memory_gib(layer_step(stock, x, grad)), peak_memory_gib(layer_step(fp4, x, grad))

    log("\n| | stock BF16 dispatch | FP4 dispatch | FP4 / stock |")
    log("| --- | ---: | ---: | ---: |")
    log(f"| dispatch bytes per rank (max over ranks) | {bf16_bytes / 2**20:.1f} MiB | {fp4_bytes / 2**20:.1f} MiB "
        f"| {fp4_bytes / bf16_bytes:.1%} |")
    log(f"| dispatch phase, forward (ms) | {bf16_ms:.3f} | {fp4_ms:.3f} | {fp4_ms / bf16_ms:.2f}x time "
        f"({bf16_ms / fp4_ms:.2f}x faster) |")
    for part, ms in parts_ms.items():
        log(f"| - FP4 {part} (ms) | | {ms:.3f} | |")
    log(f"| layer forward+backward (ms) | {stock_ms:.3f} | {fp4_layer_ms:.3f} | {fp4_layer_ms / stock_ms:.3f} |")
    log(f"| peak memory (GiB, max over ranks) | {stock_peak:.2f} | {fp4_peak:.2f} | {fp4_peak / stock_peak:.3f} |")
    fp4_case = f"FP4 dispatch (gradient {args.grad}) + BF16 experts"
    recorder.add(fp4_case, "dispatch bytes per rank", fp4_bytes / 2**20, "MiB", "BF16 dispatch", bf16_bytes / 2**20)
    recorder.add(fp4_case, "dispatch phase forward", fp4_ms, "ms", "BF16 all-to-all", bf16_ms)
    for part, ms in parts_ms.items():
        recorder.add(f"FP4 dispatch: {part}", "dispatch phase forward", ms, "ms", "BF16 all-to-all", bf16_ms)
    recorder.add(fp4_case, "layer forward+backward", fp4_layer_ms, "ms", STOCK, stock_ms)
    recorder.add(fp4_case, "peak memory", fp4_peak, "GiB", STOCK, stock_peak)
    if not args.no_experts_table:
        compare_experts(args, config, x, grad, stock, fp4, log, recorder)
    finish(rank, recorder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
