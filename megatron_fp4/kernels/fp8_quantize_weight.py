"""BF16 / FP16 / FP32 weights -> FP8 E4M3 with one power-of-two scale per 128x128 block, optionally
transposed on the way out (the expert GEMMs' weight operand: W for fprop, W^T for dgrad).

One program per block: the scale rule is the row quantizer's (smallest power of two with
amax / scale <= 448, never below 2^-126) over all 16384 elements; a block holding NaN / Inf gets a
NaN scale and NaN data. The FP8 experts call it once per optimizer step (experts/weight_cache.py).

All the experts' weights of one linear layer go in one launch (a third grid axis): they are
separate parameters, so the kernel reads each one through a table of their addresses. One launch
instead of one per expert matters on the host: the experts' forward and backward are short enough
that Python launch overhead shows.
"""

from typing import List, Sequence

import torch
import triton
import triton.language as tl

from ..formats import FP8_BLOCK
from ..tensors import FP8BlockWeight, FP8StackedWeights, padded_scale_columns
from ._addresses import address_table
from ._bits import fp32_bits_to_e4m3, fp8_block_scale, unpack_float_pair
from ._checks import check_float_matrix, float_kind, pair_view
from ._format_constants import E4M3_NAN
from ._sm90_spec import BuildVariant, KernelSpec

_NUM_WARPS = 8


@triton.jit
def _quantize_fp8_weight_kernel(
    w_addresses_ptr,  # int64 [E]: where each weight [ROWS, COLS / 2] of element pairs starts (_bits.unpack_float_pair)
    out_ptr,  # uint8 [E, ROWS, COLS], or [E, COLS, ROWS] when TRANSPOSE
    scales_ptr,  # fp32 [E, row blocks, SCALE_STRIDE] of the output's orientation
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    SCALE_STRIDE: tl.constexpr,
    KIND: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    BLOCK: tl.constexpr,  # 128
):
    row_block = tl.program_id(0)
    col_block = tl.program_id(1)
    weight = tl.program_id(2).to(tl.int64)
    address = tl.load(w_addresses_ptr + weight)
    # Parameters are 16-byte aligned (checked on the host): tell the compiler, for vector loads.
    if KIND == 2:
        w_pairs_ptr = tl.multiple_of(address.to(tl.pointer_type(tl.int64)), 16)
    else:
        w_pairs_ptr = tl.multiple_of(address.to(tl.pointer_type(tl.int32)), 16)
    out_ptr += weight * (ROWS * COLS)
    scales_ptr += weight * ((COLS if TRANSPOSE else ROWS) // BLOCK * SCALE_STRIDE)
    row = row_block * BLOCK + tl.arange(0, BLOCK)
    pair = col_block * (BLOCK // 2) + tl.arange(0, BLOCK // 2)
    words = tl.load(w_pairs_ptr + row[:, None].to(tl.int64) * (COLS // 2) + pair[None, :])
    lo, hi = unpack_float_pair(words, KIND)

    amax = tl.max(tl.max(tl.maximum(lo & 0x7FFFFFFF, hi & 0x7FFFFFFF), axis=1), axis=0)
    scale, inv_scale, is_nan = fp8_block_scale(amax)
    lo8 = fp32_bits_to_e4m3((lo.to(tl.float32, bitcast=True) * inv_scale).to(tl.int32, bitcast=True))
    hi8 = fp32_bits_to_e4m3((hi.to(tl.float32, bitcast=True) * inv_scale).to(tl.int32, bitcast=True))
    lo8 = tl.where(is_nan, E4M3_NAN, lo8)
    hi8 = tl.where(is_nan, E4M3_NAN, hi8)

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
    return quantize_fp8_weights([w], transpose)[0]


def quantize_fp8_weights(weights: Sequence[torch.Tensor], transpose: bool = False) -> List[FP8BlockWeight]:
    """quantize_fp8_weight of each of several weights of one shape, dtype and device, in one launch.
    The results are views of one buffer holding them all."""
    stacked = quantize_fp8_weights_stacked(weights, transpose)
    return [stacked[e] for e in range(stacked.num_experts)]


def quantize_fp8_weights_stacked(weights: Sequence[torch.Tensor], transpose: bool = False) -> FP8StackedWeights:
    """quantize_fp8_weights as one [E, rows, cols] operand (the grouped GEMMs')."""
    name = "quantize_fp8_weights"
    if not weights:
        raise ValueError(f"{name}: no weights given")
    first = weights[0]
    check_float_matrix(name, first, FP8_BLOCK)
    rows, cols = first.shape
    if rows % FP8_BLOCK:
        raise ValueError(f"{name}: rows {rows} must be a multiple of {FP8_BLOCK}")
    for w in weights[1:]:
        if (w.shape, w.dtype, w.device) != (first.shape, first.dtype, first.device) or not w.is_contiguous():
            raise ValueError(f"{name}: every weight must be contiguous and like the first ({tuple(first.shape)} "
                             f"{first.dtype} on {first.device}), got {tuple(w.shape)} {w.dtype} on {w.device}")
    out_rows, out_cols = (cols, rows) if transpose else (rows, cols)
    data = torch.empty(len(weights), out_rows, out_cols, dtype=torch.float8_e4m3fn, device=first.device)
    block_scales = torch.ones(len(weights), out_rows // FP8_BLOCK, padded_scale_columns(out_cols),
                              dtype=torch.float32, device=first.device)
    _quantize_fp8_weight_kernel[(rows // FP8_BLOCK, cols // FP8_BLOCK, len(weights))](
        address_table(name, [pair_view(w) for w in weights]),
        data.view(torch.uint8),
        block_scales,
        ROWS=rows,
        COLS=cols,
        SCALE_STRIDE=block_scales.shape[2],
        KIND=float_kind(first.dtype),
        TRANSPOSE=transpose,
        BLOCK=FP8_BLOCK,
        num_warps=_NUM_WARPS,
    )
    return FP8StackedWeights(data, block_scales)


def sm90_specs(variant: BuildVariant) -> List[KernelSpec]:
    """The kernel for a weight [2 x 2048, hidden] (fc1's shape), as sm90_build compiles it;
    transposed when the variant's ceil_rule is off, so that both variants build."""
    rows, transpose = 2 * 2048, not variant.ceil_rule
    return [KernelSpec(
        "quantize_fp8_weight", _quantize_fp8_weight_kernel,
        {"w_addresses_ptr": "*i64", "out_ptr": "*u8", "scales_ptr": "*fp32"},
        {"ROWS": rows, "COLS": variant.hidden, "SCALE_STRIDE": padded_scale_columns(variant.hidden),
         "KIND": variant.input_kind, "TRANSPOSE": transpose, "BLOCK": FP8_BLOCK},
        _NUM_WARPS, FP8_BLOCK * FP8_BLOCK)]
