"""Grouped FP8 GEMMs over the local experts' ragged token segments: one launch per GEMM.

Block scales as DeepSeek-V3 trains with them: activations and gradients in 1x128 blocks, weights
in 128x128 blocks. Every K step of 128 is one scaled product: the tile's FP8 product, accumulated in
fp32 by the tensor cores, is multiplied by the row scale times the column scale and added to an fp32
accumulator (the "promotion" DeepGEMM does; cuBLASLt's blockwise GEMM computes the same sum).

- `grouped_gemm_by_weight` (fprop, dgrad): Y[rows of expert e] = X[rows of e] W_e^T, X [M, K] in
  1x128 rows, W [E, N, K] in 128x128 blocks. The rows of all experts form one tile space: expert e
  contributes ceil(n_e / BLOCK_M) row tiles, so a small expert costs one tile, not one launch, and
  the GPU stays busy while any tile is left. Each program derives its expert from the segment offsets
  on the device (E is small), so no host sync or table is needed; the grid is sized for the worst
  case (ceil(M / BLOCK_M) + E row tiles) and the spare programs return at once.
- `grouped_gemm_by_weight_from_mxfp4` (fprop of the dispatched MXFP4 tokens, CUDA on SM90): the
  same bits as `grouped_gemm_by_weight(mxfp4_to_fp8_rows(q), ...)`, the conversion done in the
  kernel's shared memory, so no FP8 copy of the tokens is written to or read from HBM.
- `grouped_wgrad`: dW_e [N, K] = dY_e^T X_e for every expert, both operands colwise (1x128 along
  the tokens, each segment starting at a multiple of 128 columns and zero-filled past its tokens,
  as the column kernels write them). An expert without tokens gets a zero gradient.

Operand tiles are loaded through pointers, or with `GemmTiles.tma` by the Tensor Memory
Accelerator from tensor descriptors built on the host; the sums are the same.
"""

import dataclasses
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..formats import FP8_BLOCK, MXFP4_BLOCK
from ..tensors import COLWISE, ROWWISE, FP8BlockTensor, FP8StackedWeights, MXFP4Tensor, padded_scale_columns
from ._addresses import address_table
from ._e4m3_table import e4m3_magnitude_table
from ._bits import store_rounded
from ._checks import check_contiguous, check_kernel_device, check_segment_offsets
from ._sm90_spec import EXPERTS_POW2, BuildVariant, KernelSpec
from ._tile_order import swizzled, tile_of_expert
from . import grouped_fp8_gemm_ws, grouped_gemm_sm90


@dataclass(frozen=True)
class GemmTiles:
    """Output tile, warps, pipeline stages, row tiles per L2 group and how operand tiles are loaded,
    of one grouped GEMM launch."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    # 1 or 2: with 2 the program's rows are two tiles of block_m / 2 that share each B tile, so
    # that a program loads fewer bytes per FLOP while one tensor-core product at a time is live.
    row_halves: int = 1
    # Operand tiles loaded by the Tensor Memory Accelerator (host-built tensor descriptors) instead
    # of per-thread pointer loads: the copies cost no registers or instructions of the program's
    # threads, and rows past the end of A read as zeros.
    tma: bool = False
    # fprop / dgrad only, CUDA only: the Gluon kernel of grouped_fp8_gemm_ws (a producer warp
    # loading through TMA, two consumer warpgroups on the two 64-row halves), the same bits. Its
    # tiles are fixed (WARP_SPECIALIZED_ROWS below) but for num_stages and group_m.
    warp_specialized: bool = False
    # SM90 GPUs only: the CUDA C++ kernels of grouped_gemm_sm90 (persistent, a producer warpgroup and
    # two consumer warpgroups taking turns at the tensor cores), the same sums. Their tiles are fixed
    # (CUDA_TILES below) but for num_stages, block_n (128 or 256) and group_m. The default on SM90 GPUs.
    cuda_sm90: bool = False


# The fastest of benchmarks/bench_grouped_gemm.py's sweeps on H200 at DeepSeek-V3's expert shapes,
# 32 and 8 experts (rows in benchmarks/results/grouped_gemm.jsonl; the printout has every config).
# fprop / dgrad: one warpgroup on 128 x 128 as two 64-row halves sharing each weight tile, three
# stages (96 KB of shared memory: two programs per SM, one scaling its products while the other's
# tensor cores run), pointer loads: 811-928 TFLOP/s (commit a879700; 850-1086 with the scales loaded
# ahead, 044947b, where it won every sweep but one), against 650-760 for single
# 64 x 128 tiles and ~510 with four stages (one program per SM); TMA loads did not beat it (60c06af,
# 36fee30: 815-861 for 64 x 128 on three stages, 683-863 for 128 x 128 on 8 warps, 431-644 with two
# halves). wgrad (a scale per column of B): single 64 x 128 tiles, TMA, three stages (72 KB: three
# programs per SM): 654-820 TFLOP/s at 60c06af and 36fee30, against 497-636 with pointer loads and
# four stages (the previous default), 552-596 with TMA and two stages, 349-454 with TMA and five.
DEFAULT_ROWS_TILES = GemmTiles(block_m=128, block_n=128, num_warps=4, num_stages=3, row_halves=2)
DEFAULT_WGRAD_TILES = GemmTiles(block_m=64, block_n=128, num_warps=4, num_stages=3, tma=True)
# Five stages of 32 KB: one program per SM (its three partitions share it).
WARP_SPECIALIZED_ROWS = GemmTiles(block_m=128, block_n=128, num_warps=4, num_stages=5, row_halves=2, tma=True,
                                  warp_specialized=True)
# The CUDA kernels: 128 rows, three warpgroups, one CTA per SM; 128 or 256 columns. On H200 (rows in
# benchmarks/results/grouped_gemm.jsonl) three stages of 128 columns were the fastest or within a few
# percent of it for the weight gradients (256 columns lose 3-10% there) and for the forward / data
# gradients unless both N and K are >= 4096: tiles of 256 columns on two stages (half the bytes from
# L2 per B operand product) won fc1's forward (N 4096, K 7168) at 32 experts in every sweep, by 10% at
# 88829ec, and lost fc2's (N 7168, K 2048: 16 K steps a tile, too few to fill and drain two stages
# for) by 6-9% once the tiles went in groups of 4.
CUDA_TILES = GemmTiles(block_m=128, block_n=128, num_warps=12, num_stages=3, tma=True, cuda_sm90=True)
# Forward / data gradient: 4 row tiles side by side instead of 8. In-process A/B runs on H200 (same
# inputs, alternating rounds, equal bits) and the sweep of 88829ec: fc2's forward at 128 columns
# gained 13-17% (931 against 813 TFLOP/s at 32 experts), fc2's data gradient 2-7%, fc1's forward at
# 256 columns 1-2%, fc1's data gradient -2% to +4%; groups of 1 and 2 were no better than 4. The
# weight gradient was the same at 4 and 8 (within 2%), so it keeps 8.
CUDA_ROWS_TILES = dataclasses.replace(CUDA_TILES, group_m=4)
CUDA_WIDE_TILES = dataclasses.replace(CUDA_ROWS_TILES, block_n=256, num_stages=2)
WIDE_FROM = 4096  # N and K from which forward / data-gradient tiles are 256 columns wide
# The experts' data gradients (dY W_e, from W_e^T's blocks) run on the Triton kernel on every GPU: of
# the nine H200 sweeps with both kernels (6fc7393 to 89150da) it won fc1's data gradient in all nine
# at 32 experts (947-1004 TFLOP/s; the CUDA kernel's best 910-919 in the last three) and eight at 8,
# and fc2's in six at 32 experts and five at 8 (the CUDA kernel 0-5% ahead where it won in the last
# three).
DATA_GRADIENT_TILES = DEFAULT_ROWS_TILES


def default_tiles(device: torch.device, triton_tiles: GemmTiles,
                  rows_gemm: Optional[Tuple[int, int]] = None) -> GemmTiles:
    """The CUDA kernels on an SM90 GPU (they are sm_90a machine code), else the Triton kernel's tiles
    (other GPUs, and the CPU interpreter). rows_gemm: (N, K) of a forward / data-gradient GEMM (its
    CUDA tiles are 256 wide where both are >= WIDE_FROM); None for the weight gradient."""
    if not grouped_gemm_sm90.is_sm90(device):
        return triton_tiles
    if rows_gemm is None:
        return CUDA_TILES
    n, k = rows_gemm
    wide = n >= WIDE_FROM and k >= WIDE_FROM and n % CUDA_WIDE_TILES.block_n == 0
    return CUDA_WIDE_TILES if wide else CUDA_ROWS_TILES



@triton.jit
def _tile(operand, pointers, first_row, k0, TRANSPOSED: tl.constexpr, TMA: tl.constexpr):
    """An operand tile of this K step: with TMA, the operand's descriptor tile at (first_row, k0)
    (32-bit coordinates), transposed when TRANSPOSED; else the load at `pointers` (built in the
    orientation wanted, moved on by a K step each time by the kernel; None with TMA)."""
    if TMA:
        tile = operand.load([first_row.to(tl.int32), k0.to(tl.int32)])
        if TRANSPOSED:
            tile = tile.T
    else:
        tile = tl.load(pointers)
    return tile


@triton.jit
def _scaled_add(acc, product, row_scales, b_scale, B_SCALE_PER_COLUMN: tl.constexpr):
    if B_SCALE_PER_COLUMN:
        scale = row_scales[:, None] * b_scale[None, :]
    else:
        scale = (row_scales * b_scale)[:, None]
    return acc + product * scale


@triton.jit
def _step_scales(a_scale_top, a_scale_bottom, b_scale, k_block, a_step, b_step, ROW_HALVES: tl.constexpr,
                 valid=True):
    """(top rows' scales, bottom rows' scales, B's scale or scales) of K step k_block, the scale
    pointers moving a_step / b_step elements per step (the bottom ones are the top ones when there
    is one row half; zeros unless `valid`)."""
    top = tl.load(a_scale_top + k_block * a_step, mask=valid, other=0.0)
    bottom = tl.load(a_scale_bottom + k_block * a_step, mask=valid, other=0.0) if ROW_HALVES == 2 else top
    return top, bottom, tl.load(b_scale + k_block * b_step, mask=valid, other=0.0)


@triton.jit
def _grouped_gemm_rows_kernel(
    a,  # fp8 [M, K] row-major: a pointer, or with TMA a descriptor of [BLOCK_M / ROW_HALVES, 128] tiles
    a_scales_ptr,  # fp32 [K / 128, M]
    b,  # fp8 [E * N, K] (the experts' [N, K] stacked): a pointer, or with TMA a descriptor of 128 x 128 tiles
    b_scales_ptr,  # fp32 [E, N / 128, B_SCALE_STRIDE]
    offsets_ptr,  # int64 [E + 1]: expert e owns rows [offsets[e], offsets[e + 1])
    c_ptr,  # [M, N] of the output dtype (BF16 as int16: store_rounded)
    num_rows,
    num_experts,
    num_tiles_m,  # an upper bound: ceil(M / BLOCK_M) + E
    N: tl.constexpr,
    K: tl.constexpr,
    B_SCALE_STRIDE: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # 128: one weight block
    BLOCK_K: tl.constexpr,  # 128: one scale step
    GROUP_M: tl.constexpr,
    ROW_HALVES: tl.constexpr,
    TMA: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    SUB_M: tl.constexpr = BLOCK_M // ROW_HALVES
    num_tiles_n: tl.constexpr = N // BLOCK_N
    tile_m, tile_n = swizzled(tl.program_id(0), num_tiles_m, num_tiles_n, GROUP_M)
    expert, first_row, end_row = tile_of_expert(offsets_ptr, num_experts, tile_m, tl.arange(0, EXPERTS_POW2), BLOCK_M)
    if expert < num_experts:
        rows = first_row + tl.arange(0, SUB_M)
        # Rows past the expert's end belong to the next expert (or are past M): their products are
        # computed and never stored, so only the end of the tensor bounds the loads (pointer loads
        # clamp to the last row, TMA reads zeros past it).
        top = tl.minimum(rows, num_rows - 1).to(tl.int64)
        bottom = tl.minimum(rows + SUB_M, num_rows - 1).to(tl.int64)
        expert64 = expert.to(tl.int64)
        # The tiles' pointers, moved on by BLOCK_K columns per K step (TMA needs none).
        a_top = None
        a_bottom = None
        w_tile = None
        if not TMA:
            ks = tl.arange(0, BLOCK_K)
            a_top = a + top[:, None] * K + ks[None, :]
            a_bottom = a + bottom[:, None] * K + ks[None, :]
            w_tile = b + expert64 * N * K + (tile_n * BLOCK_N + tl.arange(0, BLOCK_N))[None, :].to(tl.int64) * K \
                + ks[:, None]
        a_scale_top = a_scales_ptr + top
        a_scale_bottom = a_scales_ptr + bottom
        # BLOCK_N is one weight block: one B scale per K block.
        b_scale = b_scales_ptr + (expert64 * (N // BLOCK_K) + tile_n) * B_SCALE_STRIDE
        acc_top = tl.zeros((SUB_M, BLOCK_N), dtype=tl.float32)
        acc_bottom = tl.zeros((SUB_M, BLOCK_N), dtype=tl.float32)
        # Each K step's scales are new cache lines, whose latency from L2 is longer than a product:
        # they are loaded a step ahead (the last step reloads its own).
        sa_top, sa_bottom, sb = _step_scales(a_scale_top, a_scale_bottom, b_scale, 0, num_rows, 1, ROW_HALVES)
        for k_block in range(K // BLOCK_K):
            k0 = k_block * BLOCK_K
            next_sa_top, next_sa_bottom, next_sb = _step_scales(
                a_scale_top, a_scale_bottom, b_scale, tl.minimum(k_block + 1, K // BLOCK_K - 1), num_rows, 1,
                ROW_HALVES)
            w = _tile(b, w_tile, expert * N + tile_n * BLOCK_N, k0, True, TMA)
            acc_top = _scaled_add(acc_top, tl.dot(_tile(a, a_top, first_row, k0, False, TMA), w), sa_top, sb, False)
            if ROW_HALVES == 2:
                acc_bottom = _scaled_add(acc_bottom, tl.dot(_tile(a, a_bottom, first_row + SUB_M, k0, False, TMA), w),
                                         sa_bottom, sb, False)
            if not TMA:
                a_top += BLOCK_K
                a_bottom += BLOCK_K
                w_tile += BLOCK_K
            sa_top, sa_bottom, sb = next_sa_top, next_sa_bottom, next_sb
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        out = c_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
        store_rounded(out, acc_top, (rows < end_row)[:, None], OUT_BF16)
        if ROW_HALVES == 2:
            store_rounded(out + SUB_M * N, acc_bottom, (rows + SUB_M < end_row)[:, None], OUT_BF16)


@triton.jit
def _grouped_wgrad_kernel(
    a,  # fp8 [N, capacity]: dY^T, colwise; a pointer, or with TMA a descriptor of [BLOCK_M / ROW_HALVES, 128] tiles
    a_scales_ptr,  # fp32 [capacity / 128, N]
    b,  # fp8 [K, capacity]: X^T, colwise; a pointer, or with TMA a descriptor of [BLOCK_N, 128] tiles
    b_scales_ptr,  # fp32 [capacity / 128, K]
    offsets_ptr,  # int64 [E + 1]: expert e owns columns [offsets[e], offsets[e + 1]), multiples of 128
    c_ptr,  # [E, N, K] of the output dtype; with ACCUMULATE int64 [E]: where each expert's fp32 [N, K] is
    row_stride,  # the operands' token capacity (a multiple of 128)
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # 128: one scale step (one block of tokens)
    GROUP_M: tl.constexpr,
    ROW_HALVES: tl.constexpr,
    TMA: tl.constexpr,
    ACCUMULATE: tl.constexpr,  # add into fp32 buffers (Megatron's main_grad) instead of writing c
    OUT_BF16: tl.constexpr,
):
    SUB_M: tl.constexpr = BLOCK_M // ROW_HALVES
    tiles_per_expert: tl.constexpr = (N // BLOCK_M) * (K // BLOCK_N)
    expert = tl.program_id(0) // tiles_per_expert
    tile_m, tile_n = swizzled(tl.program_id(0) % tiles_per_expert, N // BLOCK_M, K // BLOCK_N, GROUP_M)
    # Segments start at multiples of 128 columns: said to the compiler, for 16-byte async copies
    # (pointer loads; TMA copies whole tiles anyway).
    first_col = tl.multiple_of(tl.load(offsets_ptr + expert), BLOCK_K)
    end_col = tl.load(offsets_ptr + expert + 1)
    rows = tile_m * BLOCK_M + tl.arange(0, SUB_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # The tiles' pointers, moved on by BLOCK_K tokens per step (TMA needs none).
    a_top = None
    a_bottom = None
    x_tile = None
    if not TMA:
        tokens = first_col + tl.arange(0, BLOCK_K)
        a_top = a + rows[:, None].to(tl.int64) * row_stride + tokens[None, :]
        a_bottom = a_top + SUB_M * row_stride
        x_tile = b + cols[None, :].to(tl.int64) * row_stride + tokens[:, None]
    a_scale_top = a_scales_ptr + (first_col // BLOCK_K) * N + rows
    a_scale_bottom = a_scale_top + SUB_M
    b_scale = b_scales_ptr + (first_col // BLOCK_K) * K + cols
    acc_top = tl.zeros((SUB_M, BLOCK_N), dtype=tl.float32)
    acc_bottom = tl.zeros((SUB_M, BLOCK_N), dtype=tl.float32)
    # The scales a step ahead, as in the rows kernel (an expert without tokens has none to load).
    num_k = (end_col - first_col) // BLOCK_K
    sa_top, sa_bottom, sb = _step_scales(a_scale_top, a_scale_bottom, b_scale, 0, N, K, ROW_HALVES, num_k > 0)
    for k_block in range(num_k):
        k0 = first_col + k_block * BLOCK_K
        next_sa_top, next_sa_bottom, next_sb = _step_scales(a_scale_top, a_scale_bottom, b_scale,
                                                            tl.minimum(k_block + 1, num_k - 1), N, K, ROW_HALVES)
        x = _tile(b, x_tile, tile_n * BLOCK_N, k0, True, TMA)
        acc_top = _scaled_add(acc_top, tl.dot(_tile(a, a_top, tile_m * BLOCK_M, k0, False, TMA), x), sa_top, sb, True)
        if ROW_HALVES == 2:
            acc_bottom = _scaled_add(acc_bottom, tl.dot(_tile(a, a_bottom, tile_m * BLOCK_M + SUB_M, k0, False, TMA),
                                                        x), sa_bottom, sb, True)
        if not TMA:
            a_top += BLOCK_K
            a_bottom += BLOCK_K
            x_tile += BLOCK_K
        sa_top, sa_bottom, sb = next_sa_top, next_sa_bottom, next_sb
    _store_wgrad(c_ptr, expert, rows, cols, acc_top, N, K, ACCUMULATE, OUT_BF16)
    if ROW_HALVES == 2:
        _store_wgrad(c_ptr, expert, rows + SUB_M, cols, acc_bottom, N, K, ACCUMULATE, OUT_BF16)


@triton.jit
def _store_wgrad(c_ptr, expert, rows, cols, acc, N: tl.constexpr, K: tl.constexpr, ACCUMULATE: tl.constexpr,
                 OUT_BF16: tl.constexpr):
    """One tile of expert `expert`'s weight gradient: written, or added to its fp32 buffer."""
    within = rows[:, None].to(tl.int64) * K + cols[None, :]
    if ACCUMULATE:
        out = tl.load(c_ptr + expert).to(tl.pointer_type(tl.float32)) + within
        tl.store(out, tl.load(out) + acc)
    else:
        store_rounded(c_ptr + expert.to(tl.int64) * N * K + within, acc, None, OUT_BF16)


def _check_tiles(name: str, tiles: GemmTiles, n: int, k: int) -> None:
    """Tiles the kernel takes for an output of n columns and a reduction over k (k: the forward's K, or
    the weight gradient's output columns, its K)."""
    if tiles.cuda_sm90 and tiles != dataclasses.replace(CUDA_TILES, num_stages=tiles.num_stages, block_n=tiles.block_n,
                                                        group_m=tiles.group_m):
        raise ValueError(f"{name}: the CUDA kernel takes {CUDA_TILES} but for num_stages, block_n and group_m, got "
                         f"{tiles}")
    if not tiles.cuda_sm90 and (tiles.block_n != FP8_BLOCK or tiles.row_halves not in (1, 2)):
        raise ValueError(f"{name}: block_n must be {FP8_BLOCK} (one weight block) and row_halves 1 or 2, got {tiles}")
    fixed = dict(block_m=WARP_SPECIALIZED_ROWS.block_m, num_warps=WARP_SPECIALIZED_ROWS.num_warps, row_halves=2,
                 tma=True)
    if tiles.warp_specialized and any(getattr(tiles, key) != value for key, value in fixed.items()):
        raise ValueError(f"{name}: the warp-specialized kernel takes {fixed} (only num_stages and group_m vary), "
                         f"got {tiles}")
    if n % FP8_BLOCK or k % FP8_BLOCK:
        raise ValueError(f"{name}: N {n} and K {k} must be multiples of {FP8_BLOCK}")


def grouped_gemm_by_weight(rows: FP8BlockTensor, weights: FP8StackedWeights, row_offsets: torch.Tensor,
                           out_dtype=torch.bfloat16, tiles: Optional[GemmTiles] = None,
                           check_offsets: bool = True) -> torch.Tensor:
    """[M, N]: rows [row_offsets[e], row_offsets[e + 1]) of `rows` (1x128, [M, K]) times weights[e]^T
    (128x128, [N, K]) for every expert e. row_offsets: int64 [E + 1] on the rows' device, from 0 to M,
    never decreasing. tiles: default_tiles(device, DEFAULT_ROWS_TILES, (N, K)) when None. check_offsets:
    assert row_offsets' values on the device (_checks.check_segment_offsets: no host sync, a few small launches);
    a caller whose offsets are right by construction may skip it."""
    name = "grouped_gemm_by_weight"
    if not isinstance(rows, FP8BlockTensor) or rows.layout != ROWWISE:
        raise TypeError(f"{name}: expected a rowwise FP8BlockTensor")
    if not isinstance(weights, FP8StackedWeights):
        raise TypeError(f"{name}: expected FP8StackedWeights, got {type(weights).__name__}")
    check_kernel_device(name, rows.data)
    check_contiguous(name, "rows.block_scales", rows.block_scales)
    num_rows, k = rows.shape
    num_experts, n, weight_k = weights.data.shape
    if weight_k != k:
        raise ValueError(f"{name}: the rows have K = {k}, the weights {weight_k}")
    _check_row_offsets(name, row_offsets, num_experts, rows.data.device, num_rows, check_offsets)
    if tiles is None:
        tiles = default_tiles(rows.data.device, DEFAULT_ROWS_TILES, (n, k))
    _check_tiles(name, tiles, n, k)
    if n % tiles.block_n:
        raise ValueError(f"{name}: N {n} must be a multiple of block_n {tiles.block_n}")
    if tiles.cuda_sm90:
        _check_cuda_launch(name, tiles, grouped_gemm_sm90.ROWS, num_experts,
                           {"M": num_rows, "E * N": num_experts * n, "K": k}, (rows.data, weights.data),
                           (rows.block_scales, weights.block_scales), out_dtype)
    if tiles.warp_specialized and not rows.data.is_cuda:
        raise RuntimeError(f"{name}: the warp-specialized kernel is Gluon, which Triton's interpreter cannot run; "
                           "pass tiles without warp_specialized on the CPU")
    out = torch.empty(num_rows, n, dtype=out_dtype, device=rows.data.device)
    if num_rows == 0:
        return out
    if tiles.cuda_sm90:
        grouped_gemm_sm90.launch_rows(rows.data, rows.block_scales, weights.data, weights.block_scales, row_offsets,
                                      _stored(out), _cuda_output_mode(name, out_dtype), tiles.num_stages,
                                      tiles.block_n, tiles.group_m)
        return out
    num_tiles_m = triton.cdiv(num_rows, tiles.block_m) + num_experts
    if tiles.warp_specialized:
        _check_operand(name, rows.data, True)  # the kernel builds Gluon's own descriptors
        _check_operand(name, weights.data, True)
        grouped_fp8_gemm_ws.launch_rows(
            rows.data, rows.block_scales, weights.data.view(num_experts * n, k), weights.block_scales, row_offsets,
            _stored(out), num_tiles_m, n // tiles.block_n, n, k, triton.next_power_of_2(num_experts), tiles.group_m,
            tiles.num_stages, out_dtype == torch.bfloat16)
        return out
    sub_m = tiles.block_m // tiles.row_halves
    _grouped_gemm_rows_kernel[(num_tiles_m * (n // tiles.block_n),)](
        _operand(name, rows.data, (sub_m, FP8_BLOCK), tiles.tma), rows.block_scales,
        _operand(name, weights.data.view(num_experts * n, k), (tiles.block_n, FP8_BLOCK), tiles.tma),
        weights.block_scales, row_offsets, _stored(out), num_rows, num_experts, num_tiles_m,
        N=n, K=k, B_SCALE_STRIDE=weights.block_scales.shape[2], EXPERTS_POW2=triton.next_power_of_2(num_experts),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=FP8_BLOCK, GROUP_M=tiles.group_m,
        ROW_HALVES=tiles.row_halves, TMA=tiles.tma, OUT_BF16=out_dtype == torch.bfloat16,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out


def grouped_gemm_by_weight_from_mxfp4(rows: MXFP4Tensor, weights: FP8StackedWeights, row_offsets: torch.Tensor,
                                      out_dtype=torch.bfloat16, tiles: Optional[GemmTiles] = None,
                                      check_offsets: bool = True) -> torch.Tensor:
    """grouped_gemm_by_weight(mxfp4_to_fp8_rows(rows), weights, row_offsets, ...), bit for bit, with the
    conversion inside the CUDA kernel: no FP8 copy of the rows in global memory. SM90 GPUs only (the
    Triton kernels have no such path: elsewhere convert with mxfp4_to_fp8_rows first). rows: the wire
    rows, K a multiple of 512 and 16-byte aligned with a row stride of whole 16 bytes (the kernel copies
    codes and scale bytes by TMA, whose rows are whole 16 bytes). tiles: CUDA tiles, default_tiles(device,
    DEFAULT_ROWS_TILES, (N, K)) when None. row_offsets and check_offsets: as grouped_gemm_by_weight's."""
    name = "grouped_gemm_by_weight_from_mxfp4"
    if not isinstance(rows, MXFP4Tensor):
        raise TypeError(f"{name}: expected an MXFP4Tensor, got {type(rows).__name__}")
    if not isinstance(weights, FP8StackedWeights):
        raise TypeError(f"{name}: expected FP8StackedWeights, got {type(weights).__name__}")
    num_rows, k = rows.shape
    num_experts, n, weight_k = weights.data.shape
    if weight_k != k:
        raise ValueError(f"{name}: the rows have K = {k}, the weights {weight_k}")
    if weights.data.device != rows.device:
        raise ValueError(f"{name}: the rows are on {rows.device}, the weights on {weights.data.device}")
    _check_row_offsets(name, row_offsets, num_experts, rows.device, num_rows, check_offsets)
    if tiles is None:
        tiles = default_tiles(rows.device, DEFAULT_ROWS_TILES, (n, k))
    if not tiles.cuda_sm90:
        raise ValueError(f"{name}: only the CUDA kernel (SM90) converts MXFP4 itself, got {tiles}; elsewhere "
                         f"{_CONVERT_FIRST}")
    _check_tiles(name, tiles, n, k)
    if n % tiles.block_n:
        raise ValueError(f"{name}: N {n} must be a multiple of block_n {tiles.block_n}")
    if k % _TMA_MXFP4_K:
        raise ValueError(f"{name}: K must be a multiple of {_TMA_MXFP4_K}, got {k}: the kernel copies a row's "
                         f"K / 32 scale bytes by TMA, in rows of whole 16 bytes; {_CONVERT_FIRST}")
    if rows.rows.data_ptr() % 16 or rows.rows.stride(0) % 16:
        raise ValueError(f"{name}: the kernel copies the MXFP4 rows with TMA: they must start at a 16-byte boundary "
                         f"with a row stride of whole 16 bytes, got {rows.rows.data_ptr():#x} and stride "
                         f"{rows.rows.stride(0)}")
    _check_cuda_launch(name, tiles, grouped_gemm_sm90.ROWS_MXFP4, num_experts,
                       {"M": num_rows, "E * N": num_experts * n, "K": k}, (weights.data,), (weights.block_scales,),
                       out_dtype)
    out = torch.empty(num_rows, n, dtype=out_dtype, device=rows.device)
    if num_rows:
        grouped_gemm_sm90.launch_rows_from_mxfp4(
            rows.data, rows.scales, _device_e4m3_table(rows.device), weights.data, weights.block_scales, row_offsets,
            _stored(out), _cuda_output_mode(name, out_dtype), tiles.num_stages, tiles.block_n, tiles.group_m)
    return out


_TMA_MXFP4_K = 16 * MXFP4_BLOCK  # K / 32 scale bytes a row: whole 16 bytes
_CONVERT_FIRST = "convert with mxfp4_to_fp8_rows and call grouped_gemm_by_weight"


def _device_e4m3_table(device: torch.device) -> torch.Tensor:
    """e4m3_magnitude_table as the kernel reads it (int32 [256, 2]) on `device`: built
    once per device (on the CPU, then copied), never inside a CUDA graph capture, where the copy would
    only be recorded."""
    if device not in _E4M3_TABLES and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("grouped_gemm_by_weight_from_mxfp4: call it once before capturing a CUDA graph (its "
                           "conversion table is copied to the GPU at the first call)")
    return _E4M3_TABLES.setdefault(device, e4m3_magnitude_table().view(torch.int32).to(device))


_E4M3_TABLES = {}


def grouped_wgrad(grad_cols: FP8BlockTensor, input_cols: FP8BlockTensor, out_dtype=torch.bfloat16,
                  accumulate_into: Optional[Sequence[torch.Tensor]] = None,
                  tiles: Optional[GemmTiles] = None, check_offsets: bool = True) -> Optional[torch.Tensor]:
    """[E, N, K]: for every expert, its columns of grad_cols ([N, capacity], dY^T) times the same
    columns of input_cols ([K, capacity], X^T) transposed; both colwise with the same segments.
    With accumulate_into (one contiguous fp32 [N, K] per expert) the fp32 sums are added there
    instead, and nothing is returned. tiles: default_tiles(device, DEFAULT_WGRAD_TILES) when None.
    check_offsets: assert on the device (no host sync) that the operands' segment offsets are equal,
    multiples of 128, from 0, never decreasing and within the capacity (_checks.check_segment_offsets); the
    column kernels write them so, and a caller passing their outputs may skip it."""
    name = "grouped_wgrad"
    if tiles is not None and tiles.warp_specialized:
        raise ValueError(f"{name}: the warp-specialized kernel computes forward and data gradients only, got {tiles}")
    for operand in (grad_cols, input_cols):
        if not isinstance(operand, FP8BlockTensor) or operand.layout != COLWISE:
            raise TypeError(f"{name}: expected colwise FP8BlockTensors")
    check_kernel_device(name, grad_cols.data)
    check_contiguous(name, "grad_cols.block_scales", grad_cols.block_scales)
    check_contiguous(name, "input_cols.block_scales", input_cols.block_scales)
    if tiles is None:
        tiles = default_tiles(grad_cols.data.device, DEFAULT_WGRAD_TILES)
    n, capacity = grad_cols.shape
    k, input_capacity = input_cols.shape
    if input_capacity != capacity:
        raise ValueError(f"{name}: the operands' token columns differ ({capacity} and {input_capacity})")
    # Both come from the same segments (the experts' counts): compared on the device, as the rest.
    offsets = grad_cols.segment_offsets
    entries = offsets.numel() if isinstance(offsets, torch.Tensor) else 0
    check_segment_offsets(name, "grad_cols.segment_offsets", offsets, entries, grad_cols.data.device, capacity,
                          exact_end=False, multiple_of=FP8_BLOCK,
                          same_as=("input_cols.segment_offsets", input_cols.segment_offsets), on_device=check_offsets)
    if n % tiles.block_m or k % tiles.block_n:
        raise ValueError(f"{name}: N {n} must be a multiple of block_m {tiles.block_m} and K {k} of block_n "
                         f"{tiles.block_n}")
    num_experts = entries - 1
    if tiles.cuda_sm90:
        _check_tiles(name, tiles, n, k)
        _check_cuda_launch(name, tiles, grouped_gemm_sm90.WGRAD, num_experts,
                           {"capacity": capacity, "E * N": num_experts * n, "K": k},
                           (grad_cols.data, input_cols.data), (grad_cols.block_scales, input_cols.block_scales),
                           out_dtype if accumulate_into is None else None)
    if accumulate_into is None:
        out = torch.empty(num_experts, n, k, dtype=out_dtype, device=grad_cols.data.device)
        target = _stored(out)
    else:
        _check_accumulators(name, accumulate_into, num_experts, (n, k), grad_cols.data.device)
        out, target = None, address_table(name, accumulate_into)
    if capacity == 0:  # no token at all: zero gradients (nothing to add); a TMA descriptor needs a width
        return None if out is None else out.zero_()
    if tiles.cuda_sm90:
        mode = grouped_gemm_sm90.ACCUMULATE_FP32 if out is None else _cuda_output_mode(name, out_dtype)
        grouped_gemm_sm90.launch_wgrad(grad_cols.data, grad_cols.block_scales, input_cols.data,
                                       input_cols.block_scales, offsets, target, mode, tiles.num_stages,
                                       tiles.block_n, tiles.group_m)
        return out
    _grouped_wgrad_kernel[(num_experts * (n // tiles.block_m) * (k // tiles.block_n),)](
        _operand(name, grad_cols.data, (tiles.block_m // tiles.row_halves, FP8_BLOCK), tiles.tma),
        grad_cols.block_scales, _operand(name, input_cols.data, (tiles.block_n, FP8_BLOCK), tiles.tma),
        input_cols.block_scales, offsets, target, capacity,
        N=n, K=k, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=FP8_BLOCK, GROUP_M=tiles.group_m,
        ROW_HALVES=tiles.row_halves, TMA=tiles.tma, ACCUMULATE=accumulate_into is not None,
        OUT_BF16=out_dtype == torch.bfloat16,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out


def _check_cuda_launch(name: str, tiles: GemmTiles, gemm, num_experts: int, sizes, operands, scales,
                       out_dtype: Optional[torch.dtype]) -> None:
    """What the CUDA kernels need (tiles, operands that tensor maps can read, scales, sizes, the output
    dtype, None when adding into fp32 buffers), then an SM90 GPU."""
    grouped_gemm_sm90.check_tiles(name, gemm, tiles.num_stages, tiles.block_n, tiles.group_m)
    for data in operands:
        _check_operand(name, data, True)
    grouped_gemm_sm90.check_operands(name, num_experts, sizes, *scales)
    if out_dtype is not None:
        _cuda_output_mode(name, out_dtype)
    grouped_gemm_sm90.check_device(name, operands[0].device)


def _cuda_output_mode(name: str, out_dtype: torch.dtype) -> int:
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"{name}: the CUDA kernel writes BF16 or fp32, got {out_dtype}")
    return grouped_gemm_sm90.STORE_BF16 if out_dtype == torch.bfloat16 else grouped_gemm_sm90.STORE_FP32


def _operand(name: str, data: torch.Tensor, block, tma: bool):
    """An FP8 operand as its kernel reads it: the tensor (pointer loads), or with TMA a tensor
    descriptor of `block` tiles."""
    _check_operand(name, data, tma)
    return TensorDescriptor.from_tensor(data, list(block)) if tma else data


def _check_operand(name: str, data: torch.Tensor, tma: bool) -> None:
    """Every kernel reads an FP8 operand as a contiguous matrix (its row stride is its width); TMA
    also needs a 16-byte aligned address."""
    if not data.is_contiguous():
        raise ValueError(f"{name}: the FP8 operands must be contiguous, got shape {tuple(data.shape)} with strides "
                         f"{data.stride()}")
    if tma and data.data_ptr() % 16:
        raise ValueError(f"{name}: TMA tiles need FP8 operands at 16-byte aligned addresses, got one at "
                         f"{data.data_ptr():#x}; pass tiles with tma=False")


def _stored(out: torch.Tensor) -> torch.Tensor:
    """The output as the kernels write it: BF16 as int16 bits rounded to nearest even by the kernel
    (Triton's interpreter truncates in .to(tl.bfloat16), the GPU rounds: the bits agree on both)."""
    return out.view(torch.int16) if out.dtype == torch.bfloat16 else out


def _check_accumulators(name: str, buffers: Sequence[torch.Tensor], num_experts: int, shape, device) -> None:
    if len(buffers) != num_experts:
        raise ValueError(f"{name}: {len(buffers)} accumulation buffers for {num_experts} experts")
    for buffer in buffers:
        if buffer.dtype != torch.float32 or tuple(buffer.shape) != tuple(shape) or not buffer.is_contiguous() \
                or buffer.device != device:
            raise ValueError(f"{name}: each accumulation buffer must be a contiguous fp32 {list(shape)} on {device}, "
                             f"got {buffer.dtype} {tuple(buffer.shape)} on {buffer.device}")


def _check_row_offsets(name: str, offsets, num_experts: int, device, num_rows: int, on_device: bool) -> None:
    """row_offsets of the forward / data-gradient GEMMs: int64 [E + 1], from 0 to M, never decreasing
    (rows past a wrong end would be left unwritten, or written out of bounds)."""
    check_segment_offsets(name, "row_offsets", offsets, num_experts + 1, device, num_rows, on_device=on_device)


def sm90_specs(variant: BuildVariant, rows_tiles: GemmTiles = DEFAULT_ROWS_TILES,
               wgrad_tiles: GemmTiles = DEFAULT_WGRAD_TILES) -> List[KernelSpec]:
    """Both kernels at their tiles (the defaults unless given) for fc1's shape at the variant's
    hidden size (fprop: N = 4096, K = hidden; wgrad: [4096, hidden]), as sm90_build compiles them."""
    n, k = 2 * 2048, variant.hidden
    return [
        KernelSpec("grouped_gemm_by_weight", _grouped_gemm_rows_kernel,
                   {"a": _fp8_operand_type(rows_tiles, rows_tiles.block_m // rows_tiles.row_halves),
                    "a_scales_ptr": "*fp32", "b": _fp8_operand_type(rows_tiles, rows_tiles.block_n),
                    "b_scales_ptr": "*fp32", "offsets_ptr": "*i64", "c_ptr": "*i16", "num_rows": "i32",
                    "num_experts": "i32", "num_tiles_m": "i32"},
                   {"N": n, "K": k, "B_SCALE_STRIDE": padded_scale_columns(k), "EXPERTS_POW2": EXPERTS_POW2,
                    "BLOCK_M": rows_tiles.block_m, "BLOCK_N": rows_tiles.block_n, "BLOCK_K": FP8_BLOCK,
                    "GROUP_M": rows_tiles.group_m, "ROW_HALVES": rows_tiles.row_halves, "TMA": rows_tiles.tma,
                    "OUT_BF16": True},
                   rows_tiles.num_warps, rows_tiles.block_m * rows_tiles.block_n, rows_tiles.num_stages),
        KernelSpec("grouped_wgrad", _grouped_wgrad_kernel,
                   {"a": _fp8_operand_type(wgrad_tiles, wgrad_tiles.block_m // wgrad_tiles.row_halves),
                    "a_scales_ptr": "*fp32", "b": _fp8_operand_type(wgrad_tiles, wgrad_tiles.block_n),
                    "b_scales_ptr": "*fp32", "offsets_ptr": "*i64", "c_ptr": "*i64", "row_stride": "i32"},
                   {"N": n, "K": k, "BLOCK_M": wgrad_tiles.block_m, "BLOCK_N": wgrad_tiles.block_n,
                    "BLOCK_K": FP8_BLOCK, "GROUP_M": wgrad_tiles.group_m, "ROW_HALVES": wgrad_tiles.row_halves,
                    "TMA": wgrad_tiles.tma, "ACCUMULATE": True, "OUT_BF16": False},
                   wgrad_tiles.num_warps, wgrad_tiles.block_m * wgrad_tiles.block_n, wgrad_tiles.num_stages),
    ]


def _fp8_operand_type(tiles: GemmTiles, tile_rows: int) -> str:
    """The compile signature of an FP8 operand: a pointer, or a descriptor of [tile_rows, 128] tiles."""
    return f"tensordesc<fp8e4nv[{tile_rows}, {FP8_BLOCK}]>" if tiles.tma else "*fp8e4nv"
