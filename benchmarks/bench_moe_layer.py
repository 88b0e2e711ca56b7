#!/usr/bin/env python3
"""Stock alltoall MoE layer vs the FP4-dispatch MoE layer (issue 3), and the four expert
configurations of issue 4, in one torchrun job.

    torchrun --nproc-per-node 4 scripts/bench_moe_layer.py                 # 32 experts over EP 4
    torchrun --nproc-per-node 2 scripts/bench_moe_layer.py --experts 16    # 16 experts over EP 2

DeepSeek-V3 layer dimensions by default (hidden 7168, expert FFN 2048, SwiGLU, top-8, 4096 tokens
per GPU, Megatron's BF16 SequentialMLP experts, no shared expert). Both layers get the same
weights, the same random tokens and the same routing. Printed on rank 0:
- dispatch bytes per rank: every token row the dispatch all-to-all carries (self included);
- dispatch phase: quantize + all-to-all + dequantize (FP4) vs the BF16 all-to-all alone, forward,
  on the real permuted tokens and splits of this routing, and each FP4 part timed alone;
- layer forward+backward time and peak memory of each layer.
Then four rows (issue 4): stock BF16; the FP8 baseline (our FP8 experts behind the BF16 dispatch,
keeping BF16 activations); FP4 dispatch + Megatron's BF16 experts; FP4 dispatch + FP8 experts.
Columns: forward+backward time, the experts' GEMM TFLOP/s (18 x hidden x FFN FLOPs per routed token
over the layer time) against an FP8 blockwise GEMM ceiling measured in the same run, bytes the layer
holds between forward and backward (allocated after forward minus before; includes the 2-byte
output), and peak memory.
Times are medians over --iters after --warmup, the slowest rank's median (CUDA events).
"""

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from run_info import run_description


def parse_args(argv, description=__doc__, experts_table=True, parse=True):
    """The shared benchmark options; parse=False hands back the parser for a script to extend."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--ffn", type=int, default=2048, help="expert FFN hidden size")
    p.add_argument("--experts", type=int, default=32, help="routed experts (divisible by the GPU count)")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per GPU")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--grad", choices=("bf16", "fp8"), default="bf16", help="FP4 dispatch gradient format")
    if experts_table:
        p.add_argument("--no-experts-table", action="store_true", help="skip issue 4's four-row experts comparison")
    return p.parse_args(argv) if parse else p


def slowest_median_ms(fn, iters: int, warmup: int) -> float:
    """Median of per-iteration CUDA-event times on this rank, then the max over ranks."""
    return interleaved_medians_ms({"fn": fn}, iters, warmup)["fn"]


def interleaved_times_ms(fns: dict, iters: int, warmup: int) -> dict:
    """This rank's per-round times of several functions measured in turns (one call of each per
    round, the order rotating), so that clock and thermal drift over the run hit all of them alike:
    for differences between rows smaller than the run-to-run spread."""
    names = list(fns)
    times = {name: [] for name in names}
    for i in range(warmup + iters):
        for name in names[i % len(names):] + names[:i % len(names)]:
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fns[name]()
            end.record()
            torch.cuda.synchronize()
            if i >= warmup:
                times[name].append(start.elapsed_time(end))
    return times


def interleaved_medians_ms(fns: dict, iters: int, warmup: int) -> dict:
    """Per function: the median of its per-round times on this rank (timed in turns,
    interleaved_times_ms), then the max over ranks."""
    times = interleaved_times_ms(fns, iters, warmup)
    medians = torch.tensor([statistics.median(t) for t in times.values()], device="cuda")
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return dict(zip(times, medians.tolist()))


def moe_config(args, world: int, **extra):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        **extra,
        num_layers=1, hidden_size=args.hidden, num_attention_heads=args.hidden // 128, num_moe_experts=args.experts,
        moe_router_topk=args.topk, moe_ffn_hidden_size=args.ffn, moe_token_dispatcher_type="alltoall",
        moe_aux_loss_coeff=1e-3, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        bf16=True, params_dtype=torch.bfloat16, expert_model_parallel_size=world, expert_tensor_parallel_size=1,
    )


def permuted_tokens_and_splits(layer, x):
    """The dispatcher's own routing and permutation of x: (permuted tokens, output splits, input splits)."""
    dispatcher = layer.token_dispatcher
    with torch.no_grad():
        probs, routing_map = layer.router(x)
        tokens, _probs = dispatcher.dispatch_preprocess(x, routing_map, probs)
        dispatcher._maybe_dtoh_and_synchronize("before_ep_alltoall", dispatcher.tokens_per_expert)
    torch.cuda.synchronize()
    return tokens, [int(n) for n in dispatcher.output_splits], [int(n) for n in dispatcher.input_splits]


def start_expert_parallel(args, what: str):
    """NCCL on this torchrun rank's GPU, Megatron's parallel state with EP = all GPUs, the seed;
    returns (rank, world size, a print that only rank 0 shows), after printing the run's header."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.experts % world:
        raise SystemExit(f"--experts {args.experts} must be divisible by the number of GPUs ({world})")
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world, expert_tensor_parallel_size=1)
    model_parallel_cuda_manual_seed(1234)
    log = print if rank == 0 else (lambda *a, **k: None)
    log(run_description())
    log(f"EP {world}, {args.experts} experts, top-{args.topk}, hidden {args.hidden}, expert FFN {args.ffn}, "
        f"{args.tokens} tokens per GPU, {what}")
    return rank, world, log


def layer_step(layer, x, grad):
    def step():
        inp = x.detach().requires_grad_(True)
        out, _ = layer(inp)
        out.backward(grad)
    return step


def held_for_backward_mib(layer, x, grad) -> float:
    """Bytes allocated by the forward and still held when backward starts (max over ranks)."""
    inp = x.detach().requires_grad_(True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out, _ = layer(inp)
    torch.cuda.synchronize()
    held = torch.tensor([(torch.cuda.memory_allocated() - before) / 2**20], device="cuda")
    out.backward(grad)
    del out
    dist.all_reduce(held, op=dist.ReduceOp.MAX)
    return float(held)


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


def compare_experts(args, config, x, grad, stock, fp4, log) -> None:
    """Issue 4's four rows, from one run, timed in turns (interleaved_medians_ms)."""
    from megatron_fp4.dispatch import FP4DispatchOptions
    from megatron_fp4.integration.standalone import build_moe_layer

    baseline = build_moe_layer(config, experts="fp8").cuda()
    fp4_fp8 = build_moe_layer(config, FP4DispatchOptions(grad_format=args.grad), experts="fp8").cuda()
    baseline.load_state_dict(stock.state_dict())
    fp4_fp8.load_state_dict(stock.state_dict())
    layers = {"stock BF16 (BF16 dispatch, Megatron's experts)": stock,
              "FP8 baseline (BF16 dispatch, our FP8 experts)": baseline,
              "FP4 dispatch + BF16 experts": fp4,
              "FP4 dispatch + FP8 experts": fp4_fp8}
    ceiling = fp8_gemm_ceiling_tflops(args)
    routed = torch.tensor([float(args.tokens * args.topk)], device="cuda")  # rows the experts see, on average
    gemm_flops = float(routed) * 18 * args.hidden * args.ffn
    times = interleaved_medians_ms({name: layer_step(layer, x, grad) for name, layer in layers.items()},
                                   args.iters, args.warmup)
    rows = {}
    for name, layer in layers.items():
        rows[name] = (times[name], held_for_backward_mib(layer, x, grad), peak_memory_gib(layer_step(layer, x, grad)))
    log(f"\nFP8 GEMM ceiling (1x128 x 128x128 scaled_mm, 16384 x {args.hidden} x {2 * args.ffn}): {ceiling:.0f} TFLOP/s")
    log("| MoE layer | forward+backward (ms) | GEMM TFLOP/s (of FP8 ceiling) | held for backward (MiB) | peak (GiB) |")
    log("| --- | ---: | ---: | ---: | ---: |")
    for name, (ms, held, peak) in rows.items():
        tflops = gemm_flops / ms / 1e9
        log(f"| {name} | {ms:.3f} | {tflops:.0f} ({tflops / ceiling:.0%}) | {held:.1f} | {peak:.2f} |")
    stock_ms, stock_held = rows["stock BF16 (BF16 dispatch, Megatron's experts)"][:2]
    base_ms, base_held = rows["FP8 baseline (BF16 dispatch, our FP8 experts)"][:2]
    ours_ms, ours_held = rows["FP4 dispatch + FP8 experts"][:2]
    log(f"Bars: FP4+FP8 no slower than the FP8 baseline ({ours_ms:.3f} vs {base_ms:.3f} ms: "
        f"{'met' if ours_ms <= base_ms else 'MISSED'}); >= 1.3x stock BF16 ({stock_ms / ours_ms:.2f}x: "
        f"{'met' if stock_ms >= 1.3 * ours_ms else 'MISSED'}); held <= 35% of stock ({ours_held / stock_held:.1%}: "
        f"{'met' if ours_held <= 0.35 * stock_held else 'MISSED'}) and <= 60% of the FP8 baseline "
        f"({ours_held / base_held:.1%}: {'met' if ours_held <= 0.6 * base_held else 'MISSED'})")


def peak_memory_gib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device="cuda")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return float(peak)


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import all_to_all

    import megatron_fp4 as mf
    from megatron_fp4.dispatch import FP4DispatchOptions, fp4_dispatch_all_to_all
    from megatron_fp4.tensors import MXFP4Tensor
    from megatron_fp4.formats import mxfp4_wire_bytes_per_row
    from megatron_fp4.integration.standalone import build_moe_layer

    rank, world, log = start_expert_parallel(args, f"FP4 gradient {args.grad}")

    config = moe_config(args, world)
    stock = build_moe_layer(config).cuda()
    fp4 = build_moe_layer(config, FP4DispatchOptions(grad_format=args.grad)).cuda()
    fp4.load_state_dict(stock.state_dict())
    g = torch.Generator(device="cuda").manual_seed(rank)
    x = torch.randn(args.tokens, 1, args.hidden, device="cuda", generator=g).bfloat16()
    grad = torch.randn(x.shape, device="cuda", generator=g).bfloat16()

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
    rows = torch.tensor([sum(input_splits)], device="cuda")
    dist.all_reduce(rows, op=dist.ReduceOp.MAX)
    bf16_bytes, fp4_bytes = int(rows) * args.hidden * 2, int(rows) * mxfp4_wire_bytes_per_row(args.hidden)

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
    log(f"\nBars: bytes 26.6% ({'met' if abs(fp4_bytes / bf16_bytes - 0.265625) < 1e-9 else 'MISSED'}); "
        f"dispatch >= 2x faster ({'met' if bf16_ms >= 2 * fp4_ms else 'MISSED'}); "
        f"layer no slower ({'met' if fp4_layer_ms <= stock_ms else 'MISSED'})")
    if not args.no_experts_table:
        compare_experts(args, config, x, grad, stock, fp4, log)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
