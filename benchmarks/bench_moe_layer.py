#!/usr/bin/env python3
"""Stock alltoall MoE layer vs the FP4-dispatch MoE layer, and five expert configurations, in one
job on 1 GPU (plain python) or under torchrun (EP = GPUs); rank 0 appends the results to
benchmarks/results/bench_moe_layer.jsonl.

    python -m benchmarks.bench_moe_layer                                      # 32 experts on 1 GPU (EP 1)
    torchrun --nproc-per-node 4 -m benchmarks.bench_moe_layer                 # 32 experts over EP 4
    torchrun --nproc-per-node 2 -m benchmarks.bench_moe_layer --experts 16    # 16 experts over EP 2

DeepSeek-V3 layer dimensions by default (hidden 7168, expert FFN 2048, SwiGLU, top-8, 4096 tokens
per GPU, Megatron's BF16 SequentialMLP experts, no shared expert). Every layer gets the same
weights, the same random tokens (58.7 MiB per GPU at the defaults, more than an H200's 50 MB L2)
and so the same routing. Printed on rank 0:
- with 2+ GPUs, the dispatch: bytes per rank (every token row the all-to-all carries, self
  included); quantize + all-to-all + dequantize (FP4) vs the BF16 all-to-all alone, forward, on the
  real permuted tokens and splits of this routing, each FP4 part timed alone; then the layer's
  forward+backward time and peak memory, stock vs FP4 dispatch. EP 1 has no all-to-all (the FP4
  dispatch there only quantizes and dequantizes): this part is skipped.
- five layers: stock BF16; the same with its experts on torch._grouped_mm (the peer a user could
  write, benchmarks/grouped_mm_experts.py, same weights); the FP8 baseline (our FP8 experts behind
  the BF16 dispatch, keeping BF16 activations); FP4 dispatch + Megatron's BF16 experts; FP4 dispatch
  + FP8 experts. First each layer's output and input gradient against the stock layer's (the
  grouped_mm peer must agree to BF16 rounding); then per layer:
  - forward+backward time: CUDA events around each step, the layers timed in turns, median of
    --iters after --warmup, the slowest rank's median;
  - the experts' GEMM rate: 18 x hidden x FFN FLOPs per routed row (fc1, fc2 and their dgrad and
    wgrad; tokens x top-k rows per GPU, nothing dropped) over the layer time, against the grouped_mm
    peer's and (CUDA) an FP8 blockwise GEMM ceiling measured in the same run;
  - host time: the GPU's idle time in a step = wall time per step (perf_counter over HOST_STEPS
    back-to-back steps between two synchronizations, no profiler) minus GPU busy time per step (the
    union of the kernel, copy and memset intervals torch.profiler records over as many more steps):
    launches, Python and host syncs that the GPU waits for. Without CUDA the whole wall time counts;
  - saved for backward: the distinct storages autograd saves in the checking step's forward, other
    than the layer's parameters and its input (device-independent);
  - (CUDA) held for backward: memory allocated after forward minus before (includes the 2-byte
    output and whatever the layer keeps outside autograd); a step's peak above the memory allocated
    before it (so without the weights of the resident layers, with the step's own weight gradients:
    every step starts with the gradients set to None, as Megatron's DDP leaves them, common.layer_step).
Rows name the stock layer as reference; the FP8 layers' times also the grouped_mm peer, FP4 + FP8
also the FP8 baseline.
"""

import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.common import (finish, interleaved_medians_ms, layer_options, layer_step, max_over_ranks, moe_config,
                               peak_memory_gib, permuted_tokens_and_splits, random_tokens, slowest_median_ms,
                               start_expert_parallel, with_lean_permute)
from benchmarks.layer_breakdown import union_length

BENCH = "bench_moe_layer"
HOST_STEPS = 5  # steps timed for the host time, at most --iters
HOST_WALL = "wall time per step over back-to-back steps"  # the reference of the host time's share


def parse_args(argv):
    p = layer_options(__doc__)
    p.add_argument("--no-experts-table", action="store_true", help="skip the five-layer experts comparison")
    p.add_argument("--gemm-variants", action="store_true",
                   help="also time the FP8 layers with one scaled_mm per expert (ExpertGemms.PER_EXPERT), with "
                   "their weights quantized per use (--moe-fp4-weights-per-use), with W^T kept for the step beside W "
                   "(--moe-fp4-keep-transposed-weights), on the Triton GEMM kernels "
                   "(ExpertGemms.GROUPED_TRITON; on SM90 the default runs the forward and weight-gradient GEMMs on "
                   "the CUDA ones), and the FP8 baseline behind megatron_fp4's permute (the FP4 layers' atomic-free "
                   "sums, BF16 dispatch)")
    return p.parse_args(argv)


def held_for_backward_mib(layer, x, grad) -> float:
    """Bytes allocated by the forward and still held when backward starts (CUDA allocator, max over ranks)."""
    inp = x.detach().requires_grad_(True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out, _ = layer(inp)
    torch.cuda.synchronize()
    held = (torch.cuda.memory_allocated() - before) / 2**20
    out.backward(grad)
    del out
    return max_over_ranks(held)


def step_peak_gib(fn) -> float:
    """Peak allocated memory while fn runs above what was allocated before it (CUDA allocator,
    max over ranks)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return max_over_ranks((torch.cuda.max_memory_allocated() - before) / 2**30)


def checked_step(layer, x, grad):
    """One forward + backward: (output, input gradient, MiB saved for backward). Saved: the
    distinct storages autograd saves during the forward, leaving out the layer's parameters and
    its input, which are held anyway (max over ranks); a view counts as its whole storage, what a
    layer keeps outside autograd (e.g. on its dispatcher) does not count."""
    inp = x.detach().requires_grad_(True)
    held_anyway = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    held_anyway.add(inp.untyped_storage().data_ptr())
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in held_anyway:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out, _ = layer(inp)
    out.backward(grad)
    return out.detach(), inp.grad, max_over_ranks(sum(saved.values()) / 2**20)


def host_ms(step, steps: int):
    """(host ms, wall ms, GPU busy ms) per step, this rank: wall over `steps` back-to-back steps
    between two synchronizations; GPU busy the union of the device activity torch.profiler records
    over `steps` more (none without CUDA); host = wall - busy, at least 0."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) * 1000 / steps
    cuda = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    device = [(e.time_range.start, e.time_range.end) for e in prof.events()
              if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = union_length(device) / 1000 / steps
    return max(wall - busy, 0.0), wall, busy


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.float()
    return ((actual.float() - expected).norm() / expected.norm()).item()


def fp8_gemm_ceiling_tflops(args) -> float:
    """TFLOP/s of one large FP8 GEMM with the experts' scaling (1x128 activations, 128x128 weights),
    shaped like fc1 with 16384 tokens, random data: torch's scaled_mm on our public quantizers."""
    import megatron_fp4 as mf

    m, k, n = 16384, args.hidden, 2 * args.ffn
    a = mf.quantize_fp8_rows(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    b, scale_b = mf.quantize_fp8_weight(torch.randn(n, k, device="cuda", dtype=torch.bfloat16)).scaled_mm_operand()
    scale_a = a.scaled_mm_scales()
    ms = slowest_median_ms(lambda: F.scaled_mm(a.data, b, scale_a, F.ScalingType.BlockWise1x128, scale_b,
                                               F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16),
                           args.iters, args.warmup)
    return 2 * m * k * n / ms / 1e9


STOCK = "stock BF16 (BF16 dispatch, Megatron's experts)"
GROUPED_MM = "BF16 dispatch + BF16 experts on torch._grouped_mm"
FP8_BASELINE = "FP8 baseline (BF16 dispatch, our FP8 experts)"
FP4_BF16 = "FP4 dispatch + BF16 experts"
FP4_FP8 = "FP4 dispatch + FP8 experts"
# The same two FP8 layers with one cuBLASLt scaled_mm per expert instead of the grouped kernels, and
# FP4 + FP8 quantizing its weights at every use instead of once per step, or keeping W^T for the step.
FP8_BASELINE_PER_EXPERT = "FP8 baseline, per-expert scaled_mm"
FP4_FP8_PER_EXPERT = "FP4 dispatch + FP8 experts, per-expert scaled_mm"
FP4_FP8_WEIGHTS_PER_USE = "FP4 dispatch + FP8 experts, weights quantized per use"
FP4_FP8_KEEP_TRANSPOSED = "FP4 dispatch + FP8 experts, W^T kept for the step"
# The grouped GEMMs on the Triton kernels where the CUDA ones are the default (SM90).
FP4_FP8_TRITON = "FP4 dispatch + FP8 experts, Triton GEMMs"
# The FP8 baseline with the FP4 layers' permute (dispatch/permute.py): what FP4 dispatch adds or saves
# apart from the permute.
FP8_BASELINE_LEAN_PERMUTE = "FP8 baseline behind megatron_fp4's permute"
GROUPED_MM_AGREES = 2e-2  # relative error bound of the peer's output and input gradient against stock


def experts_layers(args, config, stock, fp4) -> dict:
    """The five layers, all with the stock layer's weights."""
    from benchmarks.grouped_mm_experts import GroupedMMExperts
    from megatron_fp4.integration.standalone import build_moe_layer
    from megatron_fp4.options import FP4Options

    grouped = build_moe_layer(config).cuda()
    grouped.load_state_dict(stock.state_dict())
    grouped.experts = GroupedMMExperts.from_sequential_mlp(grouped.experts)
    baseline = build_moe_layer(config, FP4Options(experts="fp8")).cuda()
    fp4_fp8 = build_moe_layer(config, FP4Options(dispatch=True, dispatch_grad=args.grad, experts="fp8")).cuda()
    baseline.load_state_dict(stock.state_dict())
    fp4_fp8.load_state_dict(stock.state_dict())
    layers = {STOCK: stock, GROUPED_MM: grouped, FP8_BASELINE: baseline, FP4_BF16: fp4, FP4_FP8: fp4_fp8}
    if args.gemm_variants:
        from megatron_fp4.experts import ExpertGemms

        per_use = FP4Options(dispatch=True, dispatch_grad=args.grad, experts="fp8", weights_per_use=True)
        keep_transposed = FP4Options(dispatch=True, dispatch_grad=args.grad, experts="fp8", keep_transposed_weights=True)
        for name, options, gemms in ((FP8_BASELINE_PER_EXPERT, FP4Options(experts="fp8"), ExpertGemms.PER_EXPERT),
                                     (FP4_FP8_PER_EXPERT, FP4Options(dispatch=True, dispatch_grad=args.grad,
                                                                     experts="fp8"), ExpertGemms.PER_EXPERT),
                                     (FP4_FP8_WEIGHTS_PER_USE, per_use, ExpertGemms.GROUPED),
                                     (FP4_FP8_KEEP_TRANSPOSED, keep_transposed, ExpertGemms.GROUPED),
                                     (FP4_FP8_TRITON, FP4Options(dispatch=True, dispatch_grad=args.grad,
                                                                 experts="fp8"), ExpertGemms.GROUPED_TRITON)):
            layer = build_moe_layer(config, options).cuda()
            layer.load_state_dict(stock.state_dict())
            layer.experts.gemms = gemms
            layers[name] = layer
        layers[FP8_BASELINE_LEAN_PERMUTE] = with_lean_permute(build_moe_layer(config, FP4Options(experts="fp8")).cuda(),
                                                               config)
        layers[FP8_BASELINE_LEAN_PERMUTE].load_state_dict(stock.state_dict())
    return layers


def check_against_stock(layers: dict, x, grad, log) -> dict:
    """One step of each layer: its output and input gradient against the stock layer's (the
    grouped_mm peer must agree to BF16 rounding, else its numbers would be of another
    computation); returns each layer's MiB saved for backward (checked_step)."""
    expected_out, expected_grad, saved_mib = checked_step(layers[STOCK], x, grad)
    saved = {STOCK: saved_mib}
    log("\nrelative error against stock BF16 (this rank): output, input gradient")
    for name, layer in layers.items():
        if name == STOCK:
            continue
        out, input_grad, saved[name] = checked_step(layer, x, grad)
        errors = [relative_error(out, expected_out), relative_error(input_grad, expected_grad)]
        log(f"  {name}: {errors[0]:.1e}, {errors[1]:.1e}")
        if name == GROUPED_MM and max(errors) > GROUPED_MM_AGREES:
            raise SystemExit(f"{GROUPED_MM} disagrees with the stock layer: relative errors {errors} "
                             f"(bound {GROUPED_MM_AGREES})")
    return saved


def compare_experts(args, config, x, grad, stock, fp4, log, recorder) -> None:
    """The five layers, from one run, timed in turns (interleaved_medians_ms)."""
    layers = experts_layers(args, config, stock, fp4)
    saved = check_against_stock(layers, x, grad, log)
    cuda = torch.cuda.is_available()
    ceiling = fp8_gemm_ceiling_tflops(args) if cuda else None
    gemm_flops = args.tokens * args.topk * 18 * args.hidden * args.ffn  # rows the experts see, on average
    times = interleaved_medians_ms({name: layer_step(layer, x, grad) for name, layer in layers.items()},
                                   args.iters, args.warmup)
    steps = min(HOST_STEPS, args.iters)
    rows = {}
    for name, layer in layers.items():
        host, wall, busy = host_ms(layer_step(layer, x, grad), steps)
        rows[name] = {"ms": times[name], "TFLOP/s": gemm_flops / times[name] / 1e9, "host": max_over_ranks(host),
                      "wall": wall, "busy": busy, "saved": saved[name]}
        if cuda:
            rows[name]["held"] = held_for_backward_mib(layer, x, grad)
            rows[name]["peak"] = step_peak_gib(layer_step(layer, x, grad))
    if ceiling is not None:
        log(f"\nFP8 GEMM ceiling (1x128 x 128x128 scaled_mm, 16384 x {args.hidden} x {2 * args.ffn}): "
            f"{ceiling:.0f} TFLOP/s")
    log(f"host time: wall - GPU busy per step, rank 0, {steps} steps each")
    log("| MoE layer | forward+backward (ms) | GEMM TFLOP/s | host (wall - busy) (ms) | saved for backward (MiB) "
        "| held for backward (MiB) | step peak (GiB) |")
    log("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in rows.items():
        rate = f"{r['TFLOP/s']:.0f}" + (f" ({r['TFLOP/s'] / ceiling:.0%} of FP8)" if ceiling else "")
        log(f"| {name} | {r['ms']:.3f} | {rate} | {r['host']:.3f} ({r['wall']:.3f} - {r['busy']:.3f}) "
            f"| {r['saved']:.1f} | {r.get('held', float('nan')):.1f} | {r.get('peak', float('nan')):.2f} |")
    record_experts_rows(rows, ceiling, f"FP8 blockwise scaled_mm 16384 x {args.hidden} x {2 * args.ffn}", log, recorder)


def record_experts_rows(rows: dict, ceiling, ceiling_name: str, log, recorder) -> None:
    stock, peer = rows[STOCK], rows[GROUPED_MM]
    metrics = (("layer forward+backward", "ms", "ms"), ("host time (wall - GPU busy)", "host", "ms"),
               ("saved for backward", "saved", "MiB"), ("held for backward", "held", "MiB"),
               ("step peak above allocated before", "peak", "GiB"))
    for name, r in rows.items():
        for metric, key, unit in metrics:
            if key in r and stock[key] > 0:
                recorder.add(name, metric, r[key], unit, STOCK, stock[key])
        if r["wall"] > 0:  # the host time's share of the wall time it was taken from
            recorder.add(name, "host time (wall - GPU busy)", r["host"], "ms", HOST_WALL, r["wall"])
        recorder.add(name, "experts GEMM rate over the layer time", r["TFLOP/s"], "TFLOP/s", GROUPED_MM,
                     peer["TFLOP/s"])
        if ceiling:
            recorder.add(name, "experts GEMM rate over the layer time", r["TFLOP/s"], "TFLOP/s", ceiling_name, ceiling)
    for name in (FP8_BASELINE, FP4_FP8):
        recorder.add(name, "layer forward+backward", rows[name]["ms"], "ms", GROUPED_MM, peer["ms"])
    base, ours = rows[FP8_BASELINE], rows[FP4_FP8]
    recorder.add(FP4_FP8, "layer forward+backward", ours["ms"], "ms", FP8_BASELINE, base["ms"])
    if FP8_BASELINE_LEAN_PERMUTE in rows:
        recorder.add(FP4_FP8, "layer forward+backward", ours["ms"], "ms", FP8_BASELINE_LEAN_PERMUTE,
                     rows[FP8_BASELINE_LEAN_PERMUTE]["ms"])
    recorder.add(FP4_FP8, "saved for backward", ours["saved"], "MiB", FP8_BASELINE, base["saved"])
    if "held" in ours and base["held"] > 0:
        recorder.add(FP4_FP8, "held for backward", ours["held"], "MiB", FP8_BASELINE, base["held"])
    log(f"FP4 + FP8 vs the FP8 baseline: {ours['ms'] / base['ms']:.3f}x time, {ours['saved'] / base['saved']:.1%} "
        f"saved; vs the grouped_mm peer: {ours['ms'] / peer['ms']:.3f}x time; vs stock BF16: "
        f"{stock['ms'] / ours['ms']:.2f}x faster, {ours['saved'] / stock['saved']:.1%} saved")


def compare_dispatch(args, x, grad, stock, fp4, log, recorder) -> None:
    """Stock vs FP4 dispatch (2+ GPUs): the dispatch phase alone and in parts, and the whole layer."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import all_to_all

    import megatron_fp4 as mf
    from megatron_fp4.dispatch import fp4_dispatch_all_to_all
    from megatron_fp4.formats import mxfp4_wire_bytes_per_row
    from megatron_fp4.tensors import MXFP4Tensor

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


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_fp4.integration.standalone import build_moe_layer
    from megatron_fp4.options import FP4Options

    rank, world, log, recorder = start_expert_parallel(args, BENCH, f"FP4 gradient {args.grad}")

    config = moe_config(args, world)
    stock = build_moe_layer(config).cuda()
    fp4 = build_moe_layer(config, FP4Options(dispatch=True, dispatch_grad=args.grad)).cuda()
    fp4.load_state_dict(stock.state_dict())
    x, grad = random_tokens(args, rank)
    if world > 1:
        compare_dispatch(args, x, grad, stock, fp4, log, recorder)
    else:
        log("EP 1: no all-to-all, so no dispatch comparison (the FP4 dispatch only quantizes and dequantizes)")
    if not args.no_experts_table:
        compare_experts(args, config, x, grad, stock, fp4, log, recorder)
    finish(rank, recorder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
