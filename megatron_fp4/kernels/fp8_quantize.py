"""BF16 / FP16 / FP32 rows -> FP8 E4M3 with one power-of-two scale per 1x128 block along the row.

Used for gradients on the wire and for activations quantized per GEMM. The scale is the smallest
power of two with amax / scale <= 448 (never below 2^-126); a group holding NaN / Inf gets a NaN
scale and NaN data. Rounding to E4M3 is integer, round to nearest even.
"""

from typing import List

import torch
import triton
import triton.language as tl

from ..formats import FP8_BLOCK
from ..tensors import ROWWISE, FP8BlockTensor
from ._bits import fp32_bits_to_e4m3, fp8_block_scale, unpack_float_pair
from ._checks import TileConfig, check_float_matrix, float_kind, pair_view
from ._format_constants import E4M3_NAN
from ._sm90_spec import BuildVariant, KernelSpec

DEFAULT_CONFIG = TileConfig(block_rows=8, block_cols=4, num_warps=4)


@triton.jit
def _quantize_fp8_rows_kernel(
    x_pairs_ptr,
    out_pairs_ptr,
    scales_ptr,  # fp32 [groups, num_rows]
    num_rows,
    GROUPS_PER_ROW: tl.constexpr,
    KIND: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
):
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    group = tl.program_id(1) * BLOCK_GROUPS + tl.arange(0, BLOCK_GROUPS)
    pair = tl.arange(0, 64)
    row2 = row[:, None].to(tl.int64)
    group_mask = (row[:, None] < num_rows) & (group[None, :] < GROUPS_PER_ROW)
    offsets = row2[:, :, None] * (GROUPS_PER_ROW * 64) + group[None, :, None] * 64 + pair[None, None, :]
    words = tl.load(x_pairs_ptr + offsets, mask=group_mask[:, :, None], other=0)
    lo, hi = unpack_float_pair(words, KIND)

    amax = tl.max(tl.maximum(lo & 0x7FFFFFFF, hi & 0x7FFFFFFF), axis=2)
    scale, inv_scale, is_nan = fp8_block_scale(amax)
    inv_scale = inv_scale[:, :, None]

    lo8 = fp32_bits_to_e4m3((lo.to(tl.float32, bitcast=True) * inv_scale).to(tl.int32, bitcast=True))
    hi8 = fp32_bits_to_e4m3((hi.to(tl.float32, bitcast=True) * inv_scale).to(tl.int32, bitcast=True))
    pairs = tl.where(is_nan[:, :, None], E4M3_NAN | (E4M3_NAN << 8), lo8 | (hi8 << 8))
    tl.store(out_pairs_ptr + offsets, pairs.to(tl.int16), mask=group_mask[:, :, None])

    tl.store(scales_ptr + group[None, :].to(tl.int64) * num_rows + row2, scale, mask=group_mask)


def quantize_fp8_rows(x: torch.Tensor, config: TileConfig = DEFAULT_CONFIG) -> FP8BlockTensor:
    """x [R, C] (bf16, fp16 or fp32, C a multiple of 128) -> FP8 1x128 rowwise."""
    check_float_matrix("quantize_fp8_rows", x, FP8_BLOCK)
    num_rows, cols = x.shape
    groups = cols // FP8_BLOCK
    data = torch.empty(num_rows, cols, dtype=torch.float8_e4m3fn, device=x.device)
    block_scales = torch.empty(groups, num_rows, dtype=torch.float32, device=x.device)
    if num_rows:
        grid = (triton.cdiv(num_rows, config.block_rows), triton.cdiv(groups, config.block_cols))
        _quantize_fp8_rows_kernel[grid](
            pair_view(x),
            data.view(torch.int16),
            block_scales,
            num_rows,
            GROUPS_PER_ROW=groups,
            KIND=float_kind(x.dtype),
            BLOCK_ROWS=config.block_rows,
            BLOCK_GROUPS=config.block_cols,
            num_warps=config.num_warps,
        )
    return FP8BlockTensor(data, block_scales, ROWWISE)


def sm90_specs(variant: BuildVariant) -> List[KernelSpec]:
    """The kernel at DEFAULT_CONFIG, as sm90_build compiles it."""
    return [KernelSpec.tiled(
        "quantize_fp8_rows", _quantize_fp8_rows_kernel,
        {"x_pairs_ptr": variant.pairs_pointer, "out_pairs_ptr": "*i16", "scales_ptr": "*fp32", "num_rows": "i32"},
        {"GROUPS_PER_ROW": variant.hidden // FP8_BLOCK, "KIND": variant.input_kind},
        DEFAULT_CONFIG, "BLOCK_GROUPS", FP8_BLOCK)]
