"""BF16 / FP16 / FP32 weights -> FP8 E4M3 with one power-of-two scale per 128x128 block, optionally
transposed on the way out (the expert GEMMs' weight operand: W for fprop, W^T for dgrad).

One program per block: the scale rule is the row quantizer's (smallest power of two with
amax / scale <= 448, never below 2^-126) over all 16384 elements; a block holding NaN / Inf gets a
NaN scale and NaN data. Weights change every optimizer step, so they are quantized per use.
"""

import torch
import triton
import triton.language as tl

from ..formats import FP8_BLOCK
from ..tensors import FP8BlockWeight, padded_scale_columns
from ._bits import fp32_bits_to_e4m3, unpack_float_pair
from ._checks import check_float_matrix, float_kind, pair_view


@triton.jit
def _quantize_fp8_weight_kernel(
    w_pairs_ptr,  # [ROWS, COLS / 2] pairs of elements (see _bits.unpack_float_pair)
    out_ptr,  # uint8 [ROWS, COLS], or [COLS, ROWS] when TRANSPOSE
    scales_ptr,  # fp32 [row blocks, SCALE_STRIDE] of the output's orientation
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    SCALE_STRIDE: tl.constexpr,
    KIND: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    BLOCK: tl.constexpr,  # 128
):
    row_block = tl.program_id(0)
    col_block = tl.program_id(1)
    row = row_block * BLOCK + tl.arange(0, BLOCK)
    pair = col_block * (BLOCK // 2) + tl.arange(0, BLOCK // 2)
    words = tl.load(w_pairs_ptr + row[:, None].to(tl.int64) * (COLS // 2) + pair[None, :])
    lo, hi = unpack_float_pair(words, KIND)

    amax = tl.max(tl.max(tl.maximum(lo & 0x7FFFFFFF, hi & 0x7FFFFFFF), axis=1), axis=0)
    biased_exp = amax >> 23
    # amax = 1.m * 2^E <= 448 * 2^k = 1.75 * 2^(k + 8): k = E - 8, plus 1 when 1.m > 1.75.
    scale_exp = biased_exp - 8 + ((amax & 0x7FFFFF) > 0x600000).to(tl.int32)
    scale_exp = tl.minimum(tl.maximum(scale_exp, 1), 253)  # biased: scale >= 2^-126
    is_nan = biased_exp == 255
    inv_scale = ((254 - scale_exp) << 23).to(tl.float32, bitcast=True)
    lo8 = fp32_bits_to_e4m3((lo.to(tl.float32, bitcast=True) * inv_scale).to(tl.int32, bitcast=True))
    hi8 = fp32_bits_to_e4m3((hi.to(tl.float32, bitcast=True) * inv_scale).to(tl.int32, bitcast=True))
    lo8 = tl.where(is_nan, 0x7F, lo8)
    hi8 = tl.where(is_nan, 0x7F, hi8)
    scale = tl.where(is_nan, float("nan"), (scale_exp << 23).to(tl.float32, bitcast=True))

    if TRANSPOSE:
        # Element (r, 2p) goes to out[2p, r] and (r, 2p + 1) to out[2p + 1, r]: rows of W^T.
        even_rows = (2 * pair)[:, None].to(tl.int64) * ROWS + row[None, :]
        tl.store(out_ptr + even_rows, tl.trans(lo8).to(tl.uint8))
        tl.store(out_ptr + even_rows + ROWS, tl.trans(hi8).to(tl.uint8))
        tl.store(scales_ptr + col_block * SCALE_STRIDE + row_block, scale)
    else:
        pairs_out = (lo8 | (hi8 << 8)).to(tl.int16)
        tl.store(out_ptr.to(tl.pointer_type(tl.int16)) + row[:, None].to(tl.int64) * (COLS // 2) + pair[None, :],
                 pairs_out)
        tl.store(scales_ptr + row_block * SCALE_STRIDE + col_block, scale)


def quantize_fp8_weight(w: torch.Tensor, transpose: bool = False) -> FP8BlockWeight:
    """w [R, C] (bf16, fp16 or fp32; R and C multiples of 128) -> FP8 128x128 blocks of w, or of
    w^T when transpose; bit-identical to reference.quantize_fp8_weight."""
    check_float_matrix("quantize_fp8_weight", w, FP8_BLOCK)
    rows, cols = w.shape
    if rows % FP8_BLOCK:
        raise ValueError(f"quantize_fp8_weight: rows {rows} must be a multiple of {FP8_BLOCK}")
    out_rows, out_cols = (cols, rows) if transpose else (rows, cols)
    data = torch.empty(out_rows, out_cols, dtype=torch.float8_e4m3fn, device=w.device)
    block_scales = torch.ones(out_rows // FP8_BLOCK, padded_scale_columns(out_cols), dtype=torch.float32,
                              device=w.device)
    _quantize_fp8_weight_kernel[(rows // FP8_BLOCK, cols // FP8_BLOCK)](
        pair_view(w),
        data.view(torch.uint8),
        block_scales,
        ROWS=rows,
        COLS=cols,
        SCALE_STRIDE=block_scales.shape[1],
        KIND=float_kind(w.dtype),
        TRANSPOSE=transpose,
        BLOCK=FP8_BLOCK,
        num_warps=8,
    )
    return FP8BlockWeight(data, block_scales)
