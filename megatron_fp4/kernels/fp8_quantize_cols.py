"""BF16 / FP16 / FP32 rows of ragged expert segments -> X^T in FP8 E4M3 with 1x128 blocks along
tokens: the gradient operand of the expert wgrad GEMM, written in one pass.

Each 128-token block of an expert's segment takes, per hidden column, the smallest power-of-two
scale with amax / scale <= 448 (never below 2^-126), as the row quantizer does along rows. A block
column holding NaN / Inf gets a NaN scale and NaN data. Segments start at multiples of 128
columns and are zero past their last token (`_segments.py`); counts stay on the device.
"""

from typing import List

import torch
import triton
import triton.language as tl

from ..formats import FP8_BLOCK
from ..tensors import COLWISE, FP8BlockTensor
from ._bits import fp32_bits_to_e4m3, fp8_block_scale, unpack_float_pair
from ._checks import TileConfig, check_float_matrix, float_kind, pair_view
from ._format_constants import E4M3_NAN
from ._segments import block_source_rows, check_segments, empty_colwise, experts_pow2
from ._sm90_spec import EXPERTS_POW2, BuildVariant, KernelSpec

# block_cols counts pairs of hidden columns.
DEFAULT_CONFIG = TileConfig(block_rows=FP8_BLOCK, block_cols=16, num_warps=4)


@triton.jit
def _column_codes(bits):
    """bits [TOKENS, C] (fp32 bit patterns of one 128-token block) -> E4M3 codes and the fp32 scale
    of each column, as the row quantizer does along rows."""
    amax = tl.max(bits & 0x7FFFFFFF, axis=0)  # [C]; NaN / Inf have the largest bits
    scale, inv_scale, is_nan = fp8_block_scale(amax)
    codes = fp32_bits_to_e4m3((bits.to(tl.float32, bitcast=True) * inv_scale[None, :]).to(tl.int32, bitcast=True))
    codes = tl.where(is_nan[None, :], E4M3_NAN, codes)
    return codes, scale


@triton.jit
def _quantize_fp8_cols_kernel(
    x_pairs_ptr,  # [num_rows, HIDDEN / 2] pairs of elements (see _bits.unpack_float_pair)
    out_ptr,  # uint8 view of X^T [HIDDEN, capacity]
    scales_ptr,  # fp32 [capacity / 128, HIDDEN]
    counts_ptr,
    segment_offsets_ptr,  # int64 [E + 1], written by program (0, 0)
    num_rows,
    num_experts,
    capacity,
    HIDDEN: tl.constexpr,
    KIND: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    TOKENS: tl.constexpr,  # 128
    BLOCK_PAIRS: tl.constexpr,  # pairs of hidden columns per program
):
    column_start = tl.program_id(0) * TOKENS
    first_row, valid_rows, source_row, valid = block_source_rows(
        counts_ptr, segment_offsets_ptr, num_experts, num_rows, column_start, EXPERTS_POW2, TOKENS)
    pair = tl.program_id(1) * BLOCK_PAIRS + tl.arange(0, BLOCK_PAIRS)
    in_hidden = pair < HIDDEN // 2
    # Integer loads and bit unpacking: exact for every dtype, compiled or interpreted.
    words = tl.load(x_pairs_ptr + source_row[:, None] * (HIDDEN // 2) + pair[None, :],
                    mask=valid[:, None] & in_hidden[None, :], other=0)
    even, odd = unpack_float_pair(words, KIND)
    for half in tl.static_range(2):
        if half == 0:
            bits = even
        else:
            bits = odd
        codes, scale = _column_codes(bits)
        hidden = 2 * pair + half
        out_offsets = hidden[None, :].to(tl.int64) * capacity + column_start + tl.arange(0, TOKENS)[:, None]
        tl.store(out_ptr + out_offsets, codes.to(tl.uint8), mask=in_hidden[None, :])
        tl.store(scales_ptr + tl.program_id(0).to(tl.int64) * HIDDEN + hidden, scale, mask=in_hidden)


def quantize_fp8_cols(
    x: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    capacity=None,
    check_counts: bool = True,
    config: TileConfig = DEFAULT_CONFIG,
) -> FP8BlockTensor:
    """x [T, H] (bf16, fp16 or fp32; H a multiple of 128), rows = the experts' tokens back to back
    -> X^T [H, capacity] in FP8 with 1x128 blocks along tokens, colwise with segment offsets.

    tokens_per_expert: int32/int64 [E] on x's device (no host sync); capacity defaults to
    colwise_capacity(T, E); check_counts as in mxfp4_to_fp8_cols."""
    check_float_matrix("quantize_fp8_cols", x, FP8_BLOCK)
    num_rows, hidden = x.shape
    capacity = check_segments("quantize_fp8_cols", tokens_per_expert, x.device, num_rows, capacity, check_counts)
    num_experts = tokens_per_expert.numel()
    segment_offsets, data, block_scales = empty_colwise(hidden, capacity, num_experts, x.device)
    grid = (capacity // FP8_BLOCK, triton.cdiv(hidden // 2, config.block_cols))
    _quantize_fp8_cols_kernel[grid](
        pair_view(x),
        data.view(torch.uint8),
        block_scales,
        tokens_per_expert,
        segment_offsets,
        num_rows,
        num_experts,
        capacity,
        HIDDEN=hidden,
        KIND=float_kind(x.dtype),
        EXPERTS_POW2=experts_pow2(tokens_per_expert),
        TOKENS=FP8_BLOCK,
        BLOCK_PAIRS=config.block_cols,
        num_warps=config.num_warps,
    )
    return FP8BlockTensor(data, block_scales, COLWISE, segment_offsets)


def sm90_specs(variant: BuildVariant) -> List[KernelSpec]:
    """The kernel at DEFAULT_CONFIG, as sm90_build compiles it."""
    c = DEFAULT_CONFIG
    return [KernelSpec(
        "quantize_fp8_cols", _quantize_fp8_cols_kernel,
        {"x_pairs_ptr": variant.pairs_pointer, "out_ptr": "*u8", "scales_ptr": "*fp32", "counts_ptr": "*i64",
         "segment_offsets_ptr": "*i64", "num_rows": "i32", "num_experts": "i32", "capacity": "i32"},
        {"HIDDEN": variant.hidden, "KIND": variant.input_kind, "EXPERTS_POW2": EXPERTS_POW2, "TOKENS": FP8_BLOCK,
         "BLOCK_PAIRS": c.block_cols},
        c.num_warps, FP8_BLOCK * c.block_cols * 2)]
