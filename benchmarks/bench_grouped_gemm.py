#!/usr/bin/env python3
"""The experts' grouped FP8 GEMMs on one GPU against the dense FP8 GEMM and the BF16 grouped GEMM.

DeepSeek-V3 expert shapes (hidden 7168, expert FFN 2048), 32768 routed rows (4096 tokens x top-8)
over 32 or 8 local experts with ragged counts (a quarter of the experts empty). Per GEMM (fc1 and
fc2; fprop, dgrad and wgrad), measured in the same run:
- ours: megatron_fp4.kernels.grouped_gemm_by_weight / grouped_wgrad, at each backend and tile config
  of the sweep (the best one is the row; a second row, "at the experts' default tiles", has the
  backend and tiles the FP8 experts run by default, against the dense GEMM);
- dense_scaled_mm: torch.nn.functional.scaled_mm with the same block scales on the same total M,
  one dense GEMM (the ceiling a grouped GEMM can approach);
- grouped_mm_bf16: torch._grouped_mm in BF16 over the same segments, each rounded up to 8 rows
  (its 16-byte rule; what a user could write);
- per_expert_scaled_mm: one scaled_mm per expert from Python (ExpertGemms.PER_EXPERT's path);
- deepgemm_grouped / deepgemm_dense, where DeepGEMM is importable (benchmarks/deepgemm_peer.py: its
  contiguous-layout grouped GEMMs on the same quantized operands, copied to the layout it needs
  outside the timing, its output checked against ours; the rate counts real rows only and the row
  says how many padding rows it computed), and its dense GEMM as a second ceiling.
Times are wall time per call over back-to-back calls (the host included where it limits), inputs
random and far larger than L2. Rows: bench=grouped_gemm, metric=tflops, one per reference.

    python -m benchmarks.bench_grouped_gemm                  # 32 and 8 experts, the default sweep
    python -m benchmarks.bench_grouped_gemm --experts 32 --no-sweep
    PYTHONPATH=<deep_gemm's folder> python -m benchmarks.bench_grouped_gemm --no-sweep --deepgemm
"""

import argparse
import dataclasses
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from megatron_fp4 import kernels as K
from megatron_fp4.experts import ExpertGemms
from megatron_fp4.experts.function import grouped_backend
from megatron_fp4.formats import FP8_BLOCK
from megatron_fp4.kernels import GemmBackend, GemmTiles
from megatron_fp4.kernels.grouped_fp8_gemm import default_backend, default_rows_tiles, default_wgrad_tiles
from megatron_fp4.kernels.grouped_gemm_sm90 import CUDA_ROWS_TILES, CUDA_TILES
from megatron_fp4.kernels.grouped_gemm_triton import DEFAULT_ROWS_TILES, DEFAULT_WGRAD_TILES
from benchmarks import deepgemm_peer
from benchmarks.common import ragged_counts
from benchmarks.rows import Recorder

HIDDEN, FFN, ROUTED_ROWS = 7168, 2048, 32768
# (N, K) of each expert GEMM: forward and data gradient multiply rows by the experts' weights, the
# weight gradient two column-wise operands ([N, tokens] and [K, tokens]).
ROWS_GEMMS = {"fc1_fprop": (2 * FFN, HIDDEN), "fc2_fprop": (HIDDEN, FFN), "fc1_dgrad": (HIDDEN, 2 * FFN),
              "fc2_dgrad": (FFN, HIDDEN)}
WGRAD_GEMMS = {"fc1_wgrad": (2 * FFN, HIDDEN), "fc2_wgrad": (HIDDEN, FFN)}

# (backend, tiles): the Triton kernels' tiles first (the default off SM90, and the bits every other
# config must give), then the CUDA kernels (the default on SM90) at 128 and 256 columns per tile; the
# forward / data-gradient ones in groups of 4 row tiles (their default) and of 8 (the weight gradient's).
Config = Tuple[GemmBackend, GemmTiles]
CUDA_SWEEP = [dataclasses.replace(CUDA_TILES, num_stages=stages, block_n=block_n)
              for block_n, stages in ((128, 3), (128, 4), (256, 2), (256, 3))]
ROWS_SWEEP = [(GemmBackend.TRITON, DEFAULT_ROWS_TILES)] + [
    (GemmBackend.CUDA_SM90, tiles) for tiles in [dataclasses.replace(tiles, group_m=CUDA_ROWS_TILES.group_m)
                                                 for tiles in CUDA_SWEEP] + CUDA_SWEEP]
WGRAD_SWEEP = [(GemmBackend.TRITON, DEFAULT_WGRAD_TILES)] + [(GemmBackend.CUDA_SM90, tiles) for tiles in CUDA_SWEEP]


TABLE_REFERENCES = ("dense_scaled_mm", "grouped_mm_bf16", "per_expert_scaled_mm", "deepgemm_grouped", "deepgemm_dense")


def label(config: Config) -> str:
    """A config as the rows and the printout name it."""
    backend, tiles = config
    return f"{backend.value} {tiles}"


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


def swept(name: str, experts: int, sweep: List[Config], flops: float, iters: int,
          run: Callable[[GemmBackend, GemmTiles], torch.Tensor]) -> Dict[Config, float]:
    """TFLOP/s of `run` at each backend and tile config (printed). Every config computes the same sums
    in the same order: a result whose bits differ from the first config's is said and not timed, and
    so is a config the GPU cannot hold or this Triton cannot compile."""
    rates, expected = {}, None
    for config in sweep:
        try:
            result = run(*config)
        except (OutOfResources, CompilationError, RuntimeError) as error:
            if config == sweep[0]:
                raise
            print(f"  {name} E={experts} {label(config)}: skipped ({type(error).__name__}: "
                  f"{str(error).splitlines()[0][:200]})")
            continue
        if expected is None:
            expected = result
        elif not torch.equal(result.view(torch.int16), expected.view(torch.int16)):
            print(f"  {name} E={experts} {label(config)}: skipped (its result differs from {label(sweep[0])}'s)")
            continue
        rates[config] = tflops(flops, wall_ms(lambda: run(*config), iters, 3))
        print(f"  {name} E={experts} {label(config)}: {rates[config]:.0f} TFLOP/s")
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


def experts_rows_config(gpu: torch.device, name: str, n: int, k: int) -> Config:
    """The backend and tiles the FP8 experts (ExpertGemms.GROUPED) use for this forward / data-gradient
    GEMM: their backend, or where they leave it to the kernels (None), the device's default; its tiles."""
    backend = grouped_backend(ExpertGemms.GROUPED, name.endswith("_dgrad")) or default_backend(gpu)
    return backend, default_rows_tiles(backend, n, k)


def experts_wgrad_config(gpu: torch.device) -> Config:
    backend = grouped_backend(ExpertGemms.GROUPED) or default_backend(gpu)
    return backend, default_wgrad_tiles(backend)


def record_default(record: Callable[..., None], name: str, experts: int, rates: Dict[Config, float],
                   default: Config, references: Dict[str, float], fields: dict) -> None:
    """A row for the config the experts use by default (the layer's rate), against the dense GEMM and
    DeepGEMM where measured."""
    if default in rates:
        record(f"{name} at the experts' default tiles", experts, rates[default], default, references, fields)
    else:
        print(f"  {name} E={experts}: the experts' default {label(default)} was not measured")


def deepgemm_references(dg, name: str, grouped: deepgemm_peer.PeerCall, ours: torch.Tensor,
                        dense: Optional[deepgemm_peer.PeerCall], iters: int) -> Tuple[Dict[str, float], dict]:
    """({deepgemm_grouped, deepgemm_dense: TFLOP/s}, the row fields saying how it was measured); empty
    without DeepGEMM (dg None) or where it refused or disagreed (said on stdout)."""
    if dg is None:
        return {}, {}
    time_ms = lambda fn: wall_ms(fn, iters, 3)
    rates, fields = {}, {}
    grouped_rate, error = deepgemm_peer.checked_rate(name, grouped, ours, time_ms)
    if grouped_rate is not None:
        rates["deepgemm_grouped"] = grouped_rate
        fields = {"deepgemm_padding_rows": grouped.padding_rows, "deepgemm_relative_error": error}
    if dense is not None:
        dense_rate, _ = deepgemm_peer.checked_rate(f"{name} dense", dense, None, time_ms)
        if dense_rate is not None:
            rates["deepgemm_dense"] = dense_rate
    return rates, fields


def rows_gemm_case(name: str, m_counts: torch.Tensor, n: int, k: int, sweep: List[Config], iters: int,
                   record: Callable[..., None], default: Config, dg=None) -> None:
    """fprop / dgrad: X [M, K] (1x128) times W_e^T, W [E, N, K] (128x128)."""
    experts, m = m_counts.numel(), int(m_counts.sum())
    rows, weights, offsets, w = rows_operands(m_counts, n, k)
    flops = 2.0 * m * n * k

    ours = swept(name, experts, sweep, flops, iters,
                 lambda backend, tiles: K.grouped_gemm_by_weight(rows, weights, offsets, tiles=tiles, backend=backend,
                                                                 check_offsets=False))
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
    peer, peer_fields = {}, {}
    if dg is not None:
        mine = K.grouped_gemm_by_weight(rows, weights, offsets, tiles=default[1], backend=default[0])
        peer, peer_fields = deepgemm_references(
            dg, name, deepgemm_peer.rows_call(dg, rows, weights, m_counts.tolist()), mine,
            deepgemm_peer.dense_call(dg, rows, weights), iters)
    record(name, experts, ours[best], best,
           {"dense_scaled_mm": dense, **grouped_bf16, "per_expert_scaled_mm": loop, **peer}, peer_fields)
    record_default(record, name, experts, ours, default, {"dense_scaled_mm": dense, **peer}, peer_fields)


def wgrad_case(name: str, m_counts: torch.Tensor, n: int, k: int, sweep: List[Config], iters: int,
               record: Callable[..., None], default: Config, dg=None) -> None:
    """wgrad: dW_e [N, K] = dY_e^T X_e, both colwise (1x128 along tokens)."""
    experts, m = m_counts.numel(), int(m_counts.sum())
    grad_cols, x_cols = cols_operands(m_counts, n, k)
    flops = 2.0 * m * n * k

    ours = swept(name, experts, sweep, flops, iters,
                 lambda backend, tiles: K.grouped_wgrad(grad_cols, x_cols, tiles=tiles, backend=backend,
                                                        check_offsets=False))
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
    peer, peer_fields = {}, {}
    if dg is not None:
        mine = K.grouped_wgrad(grad_cols, x_cols, tiles=default[1], backend=default[0])
        peer, peer_fields = deepgemm_references(dg, name, deepgemm_peer.wgrad_call(dg, grad_cols, x_cols), mine, None,
                                                iters)
    record(name, experts, ours[best], best, {"dense_scaled_mm": dense, **grouped_bf16, **peer}, peer_fields)
    record_default(record, name, experts, ours, default, {"dense_scaled_mm": dense, **peer}, peer_fields)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, nargs="+", default=[32, 8], help="local experts")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-sweep", action="store_true",
                   help="only the backend and tiles the FP8 experts use by default (on SM90: the CUDA kernels, the "
                        "Triton kernel for the data gradients)")
    everything = [*ROWS_GEMMS, *WGRAD_GEMMS]
    p.add_argument("--gemms", nargs="+", choices=everything, default=everything,
                   help="the GEMMs to measure (default: all six)")
    p.add_argument("--deepgemm", action="store_true",
                   help="stop unless DeepGEMM is importable (without the flag it is measured where importable, and "
                        "the run says so where not)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_grouped_gemm needs a CUDA GPU (SM90)")
    dg = deepgemm_peer.load()
    if dg is None and args.deepgemm:
        raise SystemExit("bench_grouped_gemm: --deepgemm given and deep_gemm cannot be imported (above)")
    recorder = Recorder("grouped_gemm", gpus=1, hidden=HIDDEN, ffn=FFN, routed_rows=ROUTED_ROWS, iters=args.iters)
    print(recorder.description())
    table: List[str] = []

    def record(case: str, experts: int, value: float, config: Config, references: Dict[str, float],
               fields: dict) -> None:
        for reference, reference_value in references.items():
            recorder.add(case, "tflops", value, "TFLOP/s", reference, reference_value, better="higher",
                         local_experts=experts, tiles=label(config), **fields)
        table.append(f"| {case} | {experts} | {value:.0f} | " + " | ".join(
            f"{references[r]:.0f} ({value / references[r]:.2f}x)" if r in references else "-"
            for r in TABLE_REFERENCES) + f" | {label(config)} |")

    gpu = torch.device("cuda")
    wgrad_default = experts_wgrad_config(gpu)
    wgrad_sweep = [wgrad_default] if args.no_sweep else WGRAD_SWEEP
    for experts in args.experts:
        counts = ragged_counts(ROUTED_ROWS, experts, seed=experts)
        print(f"E={experts}: counts {counts.tolist()}")
        for name, (n, k) in ROWS_GEMMS.items():
            if name in args.gemms:
                default = experts_rows_config(gpu, name, n, k)
                rows_sweep = [default] if args.no_sweep else ROWS_SWEEP
                rows_gemm_case(name, counts, n, k, rows_sweep, args.iters, record, default, dg)
        for name, (n, k) in WGRAD_GEMMS.items():
            if name in args.gemms:
                wgrad_case(name, counts, n, k, wgrad_sweep, args.iters, record, wgrad_default, dg)
    print("| GEMM | local experts | ours TFLOP/s | " + " | ".join(TABLE_REFERENCES) + " | backend and tiles |")
    print("| --- " * (len(TABLE_REFERENCES) + 4) + "|")
    print("\n".join(table))
    recorder.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
