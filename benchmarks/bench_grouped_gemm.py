#!/usr/bin/env python3
"""The experts' grouped FP8 GEMMs on one GPU against the dense FP8 GEMM and the BF16 grouped GEMM.

DeepSeek-V3 expert shapes (hidden 7168, expert FFN 2048), 32768 routed rows (4096 tokens x top-8)
over 32 or 8 local experts with ragged counts (a quarter of the experts empty). Per GEMM (fc1 and
fc2; fprop, dgrad and wgrad), measured in the same run:
- ours: megatron_fp4.kernels.grouped_gemm_by_weight / grouped_wgrad, at each tile config of the
  sweep (the best one is the row; a second row, "at the experts' default tiles", has the config the
  FP8 experts run by default, against the dense GEMM; not for fc1_fprop_from_mxfp4, which is opt-in);
- dense_scaled_mm: torch.nn.functional.scaled_mm with the same block scales on the same total M,
  one dense GEMM (the ceiling a grouped GEMM can approach);
- grouped_mm_bf16: torch._grouped_mm in BF16 over the same segments, each rounded up to 8 rows
  (its 16-byte rule; what a user could write);
- per_expert_scaled_mm: one scaled_mm per expert from Python (the experts' previous path).
fc1_fprop_from_mxfp4 (SM90): the forward GEMM reading the dispatched MXFP4 rows itself
(grouped_gemm_by_weight_from_mxfp4) against convert_then_grouped_gemm, mxfp4_to_fp8_rows and then
the FP8 grouped GEMM at its default tiles (the same bits, checked), and the dense FP8 GEMM.
Times are wall time per call over back-to-back calls (the host included where it limits), inputs
random and far larger than L2. Rows: bench=grouped_gemm, metric=tflops, one per reference.

    python -m benchmarks.bench_grouped_gemm                  # 32 and 8 experts, the default sweep
    python -m benchmarks.bench_grouped_gemm --experts 32 --no-sweep
"""

import argparse
import dataclasses
import time
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from megatron_fp4 import kernels as K
from megatron_fp4.formats import FP8_BLOCK
from megatron_fp4.kernels import GemmTiles
from megatron_fp4.experts.function import ExpertGemms, grouped_tiles
from megatron_fp4.kernels.grouped_fp8_gemm import (CUDA_ROWS_TILES, CUDA_TILES, DEFAULT_ROWS_TILES, DEFAULT_WGRAD_TILES,
                                                   WARP_SPECIALIZED_ROWS, default_tiles)
from megatron_fp4.kernels.grouped_gemm_sm90 import is_sm90
from benchmarks.common import ragged_counts
from benchmarks.rows import Recorder

HIDDEN, FFN, ROUTED_ROWS = 7168, 2048, 32768
# (N, K) of each expert GEMM: forward and data gradient multiply rows by the experts' weights, the
# weight gradient two column-wise operands ([N, tokens] and [K, tokens]).
ROWS_GEMMS = {"fc1_fprop": (2 * FFN, HIDDEN), "fc2_fprop": (HIDDEN, FFN), "fc1_dgrad": (HIDDEN, 2 * FFN),
              "fc2_dgrad": (FFN, HIDDEN)}
WGRAD_GEMMS = {"fc1_wgrad": (2 * FFN, HIDDEN), "fc2_wgrad": (HIDDEN, FFN)}
MXFP4_GEMMS = {"fc1_fprop_from_mxfp4": (2 * FFN, HIDDEN)}  # the dispatched tokens are fc1's input

# The Triton kernels' tiles first (the default off SM90, and the bits every other config must give),
# the warp-specialized Gluon kernel at its best stage count of earlier sweeps (0.88x-1.02x of the
# Triton default at 2e84cd6; docs/kernels.md has the other runners-up), then the CUDA kernels (the
# default on SM90) at 128 and 256 columns per tile; the forward / data-gradient ones in groups of 4 row
# tiles (their default) and of 8 (the weight gradient's).
CUDA_SWEEP = [dataclasses.replace(CUDA_TILES, num_stages=stages, block_n=block_n)
              for block_n, stages in ((128, 3), (128, 4), (256, 2), (256, 3))]
ROWS_SWEEP = [DEFAULT_ROWS_TILES, dataclasses.replace(WARP_SPECIALIZED_ROWS, num_stages=5)] + [
    dataclasses.replace(tiles, group_m=CUDA_ROWS_TILES.group_m) for tiles in CUDA_SWEEP] + CUDA_SWEEP
WGRAD_SWEEP = [DEFAULT_WGRAD_TILES] + CUDA_SWEEP
MXFP4_SWEEP = [dataclasses.replace(CUDA_ROWS_TILES, num_stages=stages, block_n=block_n)
               for block_n, stages in ((128, 3), (128, 4), (256, 2))]


def wall_ms(fn: Callable[[], object], iters: int, warmup: int) -> float:
    """Wall time per call of `iters` back-to-back calls (no sync between them), after warm-up."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / iters


def tflops(flops: float, ms: float) -> float:
    return flops / ms / 1e9


def reference_tflops(name: str, flops: float, fn: Callable[[], object], iters: int) -> Dict[str, float]:
    """{name: TFLOP/s} of a reference, or {} (said on stdout) where this torch refuses its operands."""
    try:
        return {name: tflops(flops, wall_ms(fn, iters, 3))}
    except RuntimeError as error:
        print(f"  {name} not measured: {str(error).splitlines()[0]}")
        return {}


def swept(name: str, experts: int, sweep: List[GemmTiles], flops: float, iters: int,
          run: Callable[[GemmTiles], torch.Tensor]) -> Dict[GemmTiles, float]:
    """TFLOP/s of `run` at each tile config (printed). Every config computes the same sums in the same
    order: a result whose bits differ from the first config's is said and not timed, and so is a
    config the GPU cannot hold or this Triton cannot compile."""
    rates, expected = {}, None
    for tiles in sweep:
        try:
            result = run(tiles)
        except (OutOfResources, CompilationError, RuntimeError) as error:
            if tiles == sweep[0]:
                raise
            print(f"  {name} E={experts} {tiles}: skipped ({type(error).__name__}: {str(error).splitlines()[0][:200]})")
            continue
        if expected is None:
            expected = result
        elif not torch.equal(result.view(torch.int16), expected.view(torch.int16)):
            print(f"  {name} E={experts} {tiles}: skipped (its result differs from {sweep[0]}'s)")
            continue
        rates[tiles] = tflops(flops, wall_ms(lambda: run(tiles), iters, 3))
        print(f"  {name} E={experts} {tiles}: {rates[tiles]:.0f} TFLOP/s")
    return rates


def _offsets(counts: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(counts.cumsum(0), (1, 0)).cuda()


def _per_expert_loop(rows, weights, counts) -> Callable[[], None]:
    """One scaled_mm per expert with tokens, M rounded up to a multiple of 4 as cuBLASLt requires."""
    bounds, start = [], 0
    for e, n in enumerate(counts.tolist()):
        if n:
            padded = -(-n // 4) * 4
            a = rows.data[start:start + padded] if start + padded <= rows.data.shape[0] else None
            if a is not None:
                bounds.append((e, a, rows.block_scales[:, start:start + padded].contiguous().t()))
        start += n
    operands = [(a, sa, weights[e].scaled_mm_operand()) for e, a, sa in bounds]

    def run():
        for a, sa, (b, sb) in operands:
            F.scaled_mm(a, b, sa, F.ScalingType.BlockWise1x128, sb, F.ScalingType.BlockWise128x128,
                        output_dtype=torch.bfloat16)
    return run


def rows_operands(m_counts: torch.Tensor, n: int, k: int):
    """(rows, weights, offsets, the BF16 weights) of a forward / data-gradient GEMM: random X [M, K]
    in 1x128 blocks, W [E, N, K] in 128x128 blocks, the segment offsets on the GPU."""
    w = torch.randn(m_counts.numel(), n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    rows = K.quantize_fp8_rows(torch.randn(int(m_counts.sum()), k, device="cuda", dtype=torch.bfloat16))
    return rows, K.quantize_fp8_weights_stacked(list(w)), _offsets(m_counts), w


def cols_operands(m_counts: torch.Tensor, n: int, k: int):
    """(dY^T, X^T) of a weight-gradient GEMM: random, column-wise in 1x128 blocks along the tokens."""
    m, counts = int(m_counts.sum()), m_counts.cuda()
    return tuple(K.quantize_fp8_cols(torch.randn(m, width, device="cuda", dtype=torch.bfloat16), counts)
                 for width in (n, k))


def experts_default_tiles(gpu: torch.device, name: str, n: int, k: int) -> GemmTiles:
    """The tiles the FP8 experts (ExpertGemms.GROUPED) use for this forward / data-gradient GEMM: their
    choice, or where they leave it to the kernel (None), the kernel's default."""
    chosen = grouped_tiles(ExpertGemms.GROUPED, DEFAULT_ROWS_TILES, WARP_SPECIALIZED_ROWS, name.endswith("_dgrad"))
    return chosen or default_tiles(gpu, DEFAULT_ROWS_TILES, (n, k))


def record_default(record: Callable[..., None], name: str, experts: int, rates: Dict[GemmTiles, float],
                   default: GemmTiles, dense: float) -> None:
    """A row for the tiles the experts use by default (the layer's rate), against the dense GEMM."""
    if default in rates:
        record(f"{name} at the experts' default tiles", experts, rates[default], default, {"dense_scaled_mm": dense})
    else:
        print(f"  {name} E={experts}: the experts' default tiles {default} were not measured")


def rows_gemm_case(name: str, m_counts: torch.Tensor, n: int, k: int, sweep: List[GemmTiles], iters: int,
                   record: Callable[..., None], default: GemmTiles) -> None:
    """fprop / dgrad: X [M, K] (1x128) times W_e^T, W [E, N, K] (128x128)."""
    experts, m = m_counts.numel(), int(m_counts.sum())
    rows, weights, offsets, w = rows_operands(m_counts, n, k)
    flops = 2.0 * m * n * k

    ours = swept(name, experts, sweep, flops, iters,
                 lambda tiles: K.grouped_gemm_by_weight(rows, weights, offsets, tiles=tiles, check_offsets=False))
    best = max(ours, key=ours.get)

    b, sb = weights[0].scaled_mm_operand()  # the dense reference multiplies all rows by expert 0's weight
    dense = tflops(flops, wall_ms(lambda: F.scaled_mm(rows.data, b, rows.block_scales.t(), F.ScalingType.BlockWise1x128,
                                                      sb, F.ScalingType.BlockWise128x128,
                                                      output_dtype=torch.bfloat16), iters, 3))
    # torch._grouped_mm takes BF16 segments of whole 16 bytes (8 rows): the peer pads each expert's rows.
    padded = (m_counts + 7) // 8 * 8
    x_padded = torch.randn(int(padded.sum()), k, device="cuda", dtype=torch.bfloat16)
    offs32 = _offsets(padded)[1:].to(torch.int32)
    w_t = w.transpose(1, 2)  # [E, K, N]: torch._grouped_mm's B
    grouped_bf16 = reference_tflops("grouped_mm_bf16", 2.0 * int(padded.sum()) * n * k,
                                    lambda: torch._grouped_mm(x_padded, w_t, offs=offs32, out_dtype=torch.bfloat16),
                                    iters)
    loop = tflops(flops, wall_ms(_per_expert_loop(rows, weights, m_counts), iters, 3))
    record(name, experts, ours[best], best, {"dense_scaled_mm": dense, **grouped_bf16, "per_expert_scaled_mm": loop})
    record_default(record, name, experts, ours, default, dense)


def mxfp4_fprop_case(name: str, m_counts: torch.Tensor, n: int, k: int, sweep: List[GemmTiles], iters: int,
                     record: Callable[..., None]) -> None:
    """fc1 fprop of MXFP4 rows: read as they are, against converting them to FP8 first."""
    experts, m = m_counts.numel(), int(m_counts.sum())
    _, weights, offsets, _ = rows_operands(m_counts, n, k)
    tokens = K.quantize_mxfp4(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    flops = 2.0 * m * n * k

    def convert_then_gemm():
        return K.grouped_gemm_by_weight(K.mxfp4_to_fp8_rows(tokens), weights, offsets, check_offsets=False)

    expected = convert_then_gemm()
    ours = swept(name, experts, sweep, flops, iters,
                 lambda tiles: K.grouped_gemm_by_weight_from_mxfp4(tokens, weights, offsets, tiles=tiles,
                                                                   check_offsets=False))
    best = max(ours, key=ours.get)
    mine = K.grouped_gemm_by_weight_from_mxfp4(tokens, weights, offsets, tiles=best)
    if not torch.equal(mine.view(torch.int16), expected.view(torch.int16)):
        raise SystemExit(f"{name}: reading MXFP4 gave other bits than converting first")
    two_step = tflops(flops, wall_ms(convert_then_gemm, iters, 3))
    rows = K.mxfp4_to_fp8_rows(tokens)
    b, sb = weights[0].scaled_mm_operand()
    dense = tflops(flops, wall_ms(lambda: F.scaled_mm(rows.data, b, rows.block_scales.t(), F.ScalingType.BlockWise1x128,
                                                      sb, F.ScalingType.BlockWise128x128,
                                                      output_dtype=torch.bfloat16), iters, 3))
    record(name, experts, ours[best], best, {"convert_then_grouped_gemm": two_step, "dense_scaled_mm": dense})


def wgrad_case(name: str, m_counts: torch.Tensor, n: int, k: int, sweep: List[GemmTiles], iters: int,
               record: Callable[..., None], default: GemmTiles) -> None:
    """wgrad: dW_e [N, K] = dY_e^T X_e, both colwise (1x128 along tokens)."""
    experts, m = m_counts.numel(), int(m_counts.sum())
    grad_cols, x_cols = cols_operands(m_counts, n, k)
    flops = 2.0 * m * n * k

    ours = swept(name, experts, sweep, flops, iters,
                 lambda tiles: K.grouped_wgrad(grad_cols, x_cols, tiles=tiles, check_offsets=False))
    best = max(ours, key=ours.get)

    # Dense: one [N, M] x [M, K] over the same token columns (all experts' padded segments as one K).
    used = int(grad_cols.segment_offsets[-1])
    a, sa = grad_cols.data[:, :used], grad_cols.block_scales[: used // FP8_BLOCK].t()
    b, sb = x_cols.data[:, :used].t(), x_cols.block_scales[: used // FP8_BLOCK].t()
    dense_ms = wall_ms(lambda: F.scaled_mm(a, b, sa, F.ScalingType.BlockWise1x128, sb, F.ScalingType.BlockWise1x128,
                                           output_dtype=torch.bfloat16), iters, 3)
    dense = tflops(2.0 * used * n * k, dense_ms)
    padded = (m_counts + 7) // 8 * 8  # whole 16-byte BF16 segments, as torch._grouped_mm requires
    rows = int(padded.sum())
    grad_t = torch.randn(n, rows, device="cuda", dtype=torch.bfloat16)
    x_padded = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    offs32 = _offsets(padded)[1:].to(torch.int32)
    grouped_bf16 = reference_tflops("grouped_mm_bf16", 2.0 * rows * n * k,
                                    lambda: torch._grouped_mm(grad_t, x_padded, offs=offs32, out_dtype=torch.bfloat16),
                                    iters)
    record(name, experts, ours[best], best, {"dense_scaled_mm": dense, **grouped_bf16})
    record_default(record, name, experts, ours, default, dense)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, nargs="+", default=[32, 8], help="local experts")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-sweep", action="store_true",
                   help="only the tiles the FP8 experts use by default (on SM90: the CUDA kernels, the Triton kernel for "
                        "the data gradients; fc1_fprop_from_mxfp4: the CUDA kernel's default tiles)")
    everything = [*ROWS_GEMMS, *WGRAD_GEMMS, *MXFP4_GEMMS]
    p.add_argument("--gemms", nargs="+", choices=everything, default=everything,
                   help="the GEMMs to measure (default: all seven; fc1_fprop_from_mxfp4 on SM90 GPUs only)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_grouped_gemm needs a CUDA GPU (SM90)")
    recorder = Recorder("grouped_gemm", gpus=1, hidden=HIDDEN, ffn=FFN, routed_rows=ROUTED_ROWS, iters=args.iters)
    print(recorder.description())
    table: List[str] = []

    def record(case: str, experts: int, value: float, tiles: GemmTiles, references: Dict[str, float]) -> None:
        for reference, reference_value in references.items():
            recorder.add(case, "tflops", value, "TFLOP/s", reference, reference_value, better="higher",
                         local_experts=experts, tiles=str(tiles))
        table.append(f"| {case} | {experts} | {value:.0f} | " + " | ".join(
            f"{references.get(r, float('nan')):.0f} ({value / references[r]:.2f}x)" if r in references else "-"
            for r in ("dense_scaled_mm", "grouped_mm_bf16", "per_expert_scaled_mm", "convert_then_grouped_gemm"))
            + f" | {tiles} |")

    gpu = torch.device("cuda")
    wgrad_sweep = [default_tiles(gpu, DEFAULT_WGRAD_TILES)] if args.no_sweep else WGRAD_SWEEP
    for experts in args.experts:
        counts = ragged_counts(ROUTED_ROWS, experts, seed=experts)
        print(f"E={experts}: counts {counts.tolist()}")
        for name, (n, k) in ROWS_GEMMS.items():
            if name in args.gemms:
                default = experts_default_tiles(gpu, name, n, k)
                rows_sweep = [default] if args.no_sweep else ROWS_SWEEP
                rows_gemm_case(name, counts, n, k, rows_sweep, args.iters, record, default)
        for name, (n, k) in WGRAD_GEMMS.items():
            if name in args.gemms:
                wgrad_case(name, counts, n, k, wgrad_sweep, args.iters, record, default_tiles(gpu, DEFAULT_WGRAD_TILES))
        for name, (n, k) in MXFP4_GEMMS.items():
            if name in args.gemms and not is_sm90(gpu):
                print(f"{name}: not measured (its kernel runs on SM90 GPUs only)")
            elif name in args.gemms:
                mxfp4_sweep = [default_tiles(gpu, DEFAULT_ROWS_TILES, (n, k))] if args.no_sweep else MXFP4_SWEEP
                mxfp4_fprop_case(name, counts, n, k, mxfp4_sweep, args.iters, record)
    print("| GEMM | local experts | ours TFLOP/s | dense scaled_mm | grouped_mm BF16 | per-expert scaled_mm "
          "| convert + GEMM | tiles |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(table))
    recorder.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
