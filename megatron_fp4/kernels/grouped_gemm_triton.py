"""The grouped FP8 GEMMs' Triton kernels (GemmBackend.TRITON): any GPU, and Triton's interpreter on
the CPU. Called through grouped_fp8_gemm, which checks the operands; the launchers here take them
as checked.

- `_grouped_gemm_rows_kernel` (fprop, dgrad): Y[rows of expert e] = X[rows of e] W_e^T. The rows of
  all experts form one tile space: expert e contributes ceil(n_e / BLOCK_M) row tiles, so a small
  expert costs one tile, not one launch, and the GPU stays busy while any tile is left. Each program
  derives its expert from the segment offsets on the device (E is small), so no host sync or table
  is needed; the grid is sized for the worst case (ceil(M / BLOCK_M) + E row tiles) and the spare
  programs return at once.
- `_grouped_wgrad_kernel`: dW_e [N, K] = dY_e^T X_e for every expert, both operands colwise (1x128
  along the tokens, each segment starting at a multiple of 128 columns and zero-filled past its
  tokens, as the column kernels write them). An expert without tokens gets a zero gradient.

Operand tiles are loaded through pointers, or with `GemmTiles.tma` by the Tensor Memory
Accelerator from tensor descriptors built on the host; the sums are the same.
"""

from typing import List

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..formats import FP8_BLOCK
from ..tensors import FP8BlockTensor, FP8StackedWeights, padded_scale_columns
from ._bits import store_rounded
from ._sm90_spec import EXPERTS_POW2, BuildVariant, KernelSpec
from ._tile_order import swizzled, tile_of_expert
from .grouped_gemm_tiles import GemmTiles

# The fastest of benchmarks/bench_grouped_gemm.py's sweeps on H200 at DeepSeek-V3's expert shapes,
# 32 and 8 experts (rows in benchmarks/results/grouped_gemm.jsonl; the printout has every config).
# fprop / dgrad: one warpgroup on 128 x 128 as two 64-row halves sharing each weight tile, three
# stages (96 KB of shared memory: two programs per SM, one scaling its products while the other's
# tensor cores run), pointer loads, the scales loaded a step ahead: 850-1086 TFLOP/s (it won every
# sweep but one), against 650-760 for single 64 x 128 tiles and ~510 with four stages (one program
# per SM); TMA loads did not beat it. wgrad (a scale per column of B): single 64 x 128 tiles, TMA,
# three stages (72 KB: three programs per SM): 654-820 TFLOP/s, against 497-636 with pointer loads
# and four stages, 552-596 with TMA and two stages, 349-454 with TMA and five.
DEFAULT_ROWS_TILES = GemmTiles(block_m=128, block_n=128, num_warps=4, num_stages=3, row_halves=2)
DEFAULT_WGRAD_TILES = GemmTiles(block_m=64, block_n=128, num_warps=4, num_stages=3, tma=True)


def check_tiles(name: str, tiles: GemmTiles) -> None:
    if tiles.block_n != FP8_BLOCK or tiles.row_halves not in (1, 2):
        raise ValueError(f"{name}: block_n must be {FP8_BLOCK} (one weight block) and row_halves 1 or 2, got {tiles}")


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


def launch_rows(rows: FP8BlockTensor, weights: FP8StackedWeights, row_offsets: torch.Tensor, target: torch.Tensor,
                out_bf16: bool, tiles: GemmTiles) -> None:
    """Y[rows of e] = X[rows of e] W_e^T into `target` ([M, N]: BF16 as int16, or fp32); operands
    as grouped_gemm_by_weight's, checked by it."""
    num_rows, k = rows.shape
    num_experts, n, _ = weights.data.shape
    num_tiles_m = triton.cdiv(num_rows, tiles.block_m) + num_experts
    sub_m = tiles.block_m // tiles.row_halves
    _grouped_gemm_rows_kernel[(num_tiles_m * (n // tiles.block_n),)](
        _operand(rows.data, (sub_m, FP8_BLOCK), tiles.tma), rows.block_scales,
        _operand(weights.data.view(num_experts * n, k), (tiles.block_n, FP8_BLOCK), tiles.tma),
        weights.block_scales, row_offsets, target, num_rows, num_experts, num_tiles_m,
        N=n, K=k, B_SCALE_STRIDE=weights.block_scales.shape[2], EXPERTS_POW2=triton.next_power_of_2(num_experts),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=FP8_BLOCK, GROUP_M=tiles.group_m,
        ROW_HALVES=tiles.row_halves, TMA=tiles.tma, OUT_BF16=out_bf16,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )


def launch_wgrad(grad_cols: FP8BlockTensor, input_cols: FP8BlockTensor, target: torch.Tensor, accumulate: bool,
                 out_bf16: bool, tiles: GemmTiles) -> None:
    """dW_e = dY_e^T X_e for every expert into `target` ([E, N, K]: BF16 as int16, or fp32), or with
    `accumulate` added into the fp32 [N, K] buffers whose addresses `target` holds (int64 [E]);
    operands as grouped_wgrad's, checked by it, with at least one token column."""
    n, capacity = grad_cols.shape
    k = input_cols.shape[0]
    num_experts = grad_cols.segment_offsets.numel() - 1
    _grouped_wgrad_kernel[(num_experts * (n // tiles.block_m) * (k // tiles.block_n),)](
        _operand(grad_cols.data, (tiles.block_m // tiles.row_halves, FP8_BLOCK), tiles.tma),
        grad_cols.block_scales, _operand(input_cols.data, (tiles.block_n, FP8_BLOCK), tiles.tma),
        input_cols.block_scales, grad_cols.segment_offsets, target, capacity,
        N=n, K=k, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=FP8_BLOCK, GROUP_M=tiles.group_m,
        ROW_HALVES=tiles.row_halves, TMA=tiles.tma, ACCUMULATE=accumulate, OUT_BF16=out_bf16,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )


def _operand(data: torch.Tensor, block, tma: bool):
    """An FP8 operand as its kernel reads it: the tensor (pointer loads), or with TMA a tensor
    descriptor of `block` tiles."""
    return TensorDescriptor.from_tensor(data, list(block)) if tma else data


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
