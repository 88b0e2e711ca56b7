"""BF16 / FP16 / FP32 weights -> FP8 E4M3 with one power-of-two scale per 128x128 block, optionally
transposed on the way out (the expert GEMMs' weight operand: W for fprop, W^T for dgrad).

One program per block: the scale rule is the row quantizer's (smallest power of two with
amax / scale <= 448, never below 2^-126) over all 16384 elements; a block holding NaN / Inf gets a
NaN scale and NaN data. The FP8 experts call it once per optimizer step (fp8/weight_cache.py).

All the experts' weights of one linear layer go in one launch (a third grid axis): they are
separate parameters, so the kernel reads each one through a table of their addresses. One launch
instead of one per expert matters on the host: the experts' forward and backward are short enough
that Python launch overhead shows.
"""

from typing import List, Optional, Sequence

import torch
import triton
import triton.language as tl

from ..formats import FP8_BLOCK
from ..tensors import FP8BlockWeight, FP8StackedWeights, padded_scale_columns
from ._addresses import address_table
from ._bits import abs_max4, e4m3_word, fp8_block_scale, load_float_quads
from ._checks import (TileConfig, check_float_matrix, check_rows_per_pass, float_kind, launch_config, pair_view,
                      readable_at)
from ._format_constants import E4M3_NAN
from ._sm90_spec import BuildVariant, KernelSpec
from ._transposed_tiles import load_slice, store_column_words

# One 128x128 block per program. block_rows = rows per pass: 128 holds the block in registers
# (one read; wide programs, few of them per SM), fewer reads it twice, an amax pass and a convert
# pass (small programs, several per SM overlap their loads and their arithmetic, but the second
# read only hits L2 while the blocks in flight fit in it: 32 rows on 4 warps, 36 registers, may
# keep ~16 blocks of 32 KB per SM in flight, more than L2 holds at 132 SMs). Transposed, a pass of
# R rows gives each thread R / 4 x 32 / threads quads per slice; every candidate keeps that >= 2,
# so loads stay 16-byte vectors. The sweep's candidates (benchmarks/bench_quantizers.py); the
# default (first) was the fastest on H200 at 16384 x 7168 plain (86.6% of the copy) and within a
# point of the best transposed (82.4% against 83.6%).
CONFIGS = (
    TileConfig(block_rows=64, block_cols=FP8_BLOCK, num_warps=8),
    TileConfig(block_rows=FP8_BLOCK, block_cols=FP8_BLOCK, num_warps=16),
    TileConfig(block_rows=32, block_cols=FP8_BLOCK, num_warps=4),
    TileConfig(block_rows=FP8_BLOCK, block_cols=FP8_BLOCK, num_warps=8),
)
DEFAULT_CONFIG = CONFIGS[0]
INTERPRETER_CONFIG = CONFIGS[1]  # one pass: half the default's passes under the interpreter


@triton.jit
def _quantize_fp8_weight_kernel(
    w_addresses_ptr,  # int64 [E]: where each weight [ROWS, COLS] starts (read as _bits.load_float_quads)
    out_words_ptr,  # int32 view of [E, ROWS, COLS], or [E, COLS, ROWS] when TRANSPOSE
    scales_ptr,  # fp32 [E, row blocks, SCALE_STRIDE] of the output's orientation
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    SCALE_STRIDE: tl.constexpr,
    KIND: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    BLOCK: tl.constexpr,  # 128
    ROWS_PER_PASS: tl.constexpr,
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
    out_words_ptr += weight * (ROWS * COLS // 4)
    scales_ptr += weight * ((COLS if TRANSPOSE else ROWS) // BLOCK * SCALE_STRIDE)
    quad = col_block * (BLOCK // 4) + tl.arange(0, BLOCK // 4)  # blocks are whole: no masks
    first_row = row_block * BLOCK

    a, b, c, d = _load_rows(w_pairs_ptr, first_row, quad, COLS, KIND, TRANSPOSE, ROWS_PER_PASS)
    if ROWS_PER_PASS == BLOCK:
        scale, inv_scale, is_nan = fp8_block_scale(tl.max(abs_max4(a, b, c, d)))
        _store_rows(out_words_ptr, a, b, c, d, inv_scale, is_nan, first_row, quad, ROWS, COLS, TRANSPOSE)
    else:
        # Only the running elementwise max lives across the amax pass; one reduction at its end.
        amax = abs_max4(a, b, c, d)
        for r in range(ROWS_PER_PASS, BLOCK, ROWS_PER_PASS):
            a, b, c, d = _load_rows(w_pairs_ptr, first_row + r, quad, COLS, KIND, TRANSPOSE, ROWS_PER_PASS)
            amax = tl.maximum(amax, abs_max4(a, b, c, d))
        scale, inv_scale, is_nan = fp8_block_scale(tl.max(amax))
        for r in range(0, BLOCK, ROWS_PER_PASS):
            a, b, c, d = _load_rows(w_pairs_ptr, first_row + r, quad, COLS, KIND, TRANSPOSE, ROWS_PER_PASS)
            _store_rows(out_words_ptr, a, b, c, d, inv_scale, is_nan, first_row + r, quad, ROWS, COLS, TRANSPOSE)
    if TRANSPOSE:
        tl.store(scales_ptr + col_block * SCALE_STRIDE + row_block, scale)
    else:
        tl.store(scales_ptr + row_block * SCALE_STRIDE + col_block, scale)


@triton.jit
def _load_rows(w_pairs_ptr, first_row, quad, COLS: tl.constexpr, KIND: tl.constexpr, TRANSPOSE: tl.constexpr,
               ROWS_PER_PASS: tl.constexpr):
    """ROWS_PER_PASS rows from first_row, columns 4 * quad .. + 3, as four tensors a, b, c, d whose
    e4m3_word packs four consecutive output bytes: plain, the four columns of each quad (the load
    layout is the store layout); transposed, four consecutive rows (_transposed_tiles)."""
    if TRANSPOSE:
        rows = first_row + 4 * tl.arange(0, ROWS_PER_PASS // 4)
        a = load_slice(w_pairs_ptr, rows, None, quad, None, COLS // 4, KIND)
        b = load_slice(w_pairs_ptr, rows + 1, None, quad, None, COLS // 4, KIND)
        c = load_slice(w_pairs_ptr, rows + 2, None, quad, None, COLS // 4, KIND)
        d = load_slice(w_pairs_ptr, rows + 3, None, quad, None, COLS // 4, KIND)
    else:
        row = first_row + tl.arange(0, ROWS_PER_PASS)
        a, b, c, d = load_float_quads(w_pairs_ptr, row[:, None].to(tl.int64) * (COLS // 4) + quad[None, :], None, KIND)
    return a, b, c, d


@triton.jit
def _store_rows(out_words_ptr, a, b, c, d, inv_scale, is_nan, first_row, quad, ROWS: tl.constexpr,
                COLS: tl.constexpr, TRANSPOSE: tl.constexpr):
    words = tl.where(is_nan, E4M3_NAN * 0x01010101, e4m3_word(a, b, c, d, inv_scale))
    if TRANSPOSE:
        store_column_words(out_words_ptr, words, quad, None, first_row // 4, ROWS // 4)
    else:
        row = first_row + tl.arange(0, words.shape[0])
        tl.store(out_words_ptr + row[:, None].to(tl.int64) * (COLS // 4) + quad[None, :], words)


def quantize_fp8_weight(w: torch.Tensor, transpose: bool = False, config: Optional[TileConfig] = None) -> FP8BlockWeight:
    """w [R, C] (bf16, fp16 or fp32; R and C multiples of 128) -> FP8 128x128 blocks of w, or of
    w^T when transpose; bit-identical to reference.quantize_fp8_weight."""
    return quantize_fp8_weights([w], transpose, config)[0]


def quantize_fp8_weights(weights: Sequence[torch.Tensor], transpose: bool = False,
                         config: Optional[TileConfig] = None) -> List[FP8BlockWeight]:
    """quantize_fp8_weight of each of several weights of one shape, dtype and device, in one launch.
    The results are views of one buffer holding them all."""
    stacked = quantize_fp8_weights_stacked(weights, transpose, config)
    return [stacked[e] for e in range(stacked.num_experts)]


def quantize_fp8_weights_stacked(weights: Sequence[torch.Tensor], transpose: bool = False,
                                 config: Optional[TileConfig] = None) -> FP8StackedWeights:
    """quantize_fp8_weights as one [E, rows, cols] operand (the grouped GEMMs')."""
    name = "quantize_fp8_weights"
    if not weights:
        raise ValueError(f"{name}: no weights given")
    first = weights[0]
    check_float_matrix(name, first, FP8_BLOCK)
    config = launch_config(config, first.device, DEFAULT_CONFIG, INTERPRETER_CONFIG)
    check_rows_per_pass(name, config.block_rows, FP8_BLOCK)
    rows, cols = first.shape
    if rows % FP8_BLOCK:
        raise ValueError(f"{name}: rows {rows} must be a multiple of {FP8_BLOCK}")
    for w in weights[1:]:
        if (w.shape, w.dtype, w.device) != (first.shape, first.dtype, first.device) or not w.is_contiguous():
            raise ValueError(f"{name}: every weight must be contiguous and like the first ({tuple(first.shape)} "
                             f"{first.dtype} on {first.device}), got {tuple(w.shape)} {w.dtype} on {w.device}")
    # The kernel reads each weight from its address as 16-byte vectors (address_table): a view that
    # starts elsewhere is copied, the copies kept alive until the launch.
    readable = [readable_at(w, 16) for w in weights]
    out_rows, out_cols = (cols, rows) if transpose else (rows, cols)
    data = torch.empty(len(weights), out_rows, out_cols, dtype=torch.float8_e4m3fn, device=first.device)
    block_scales = torch.ones(len(weights), out_rows // FP8_BLOCK, padded_scale_columns(out_cols),
                              dtype=torch.float32, device=first.device)
    _quantize_fp8_weight_kernel[(rows // FP8_BLOCK, cols // FP8_BLOCK, len(weights))](
        address_table(name, [pair_view(w) for w in readable]),
        data.view(torch.int32),
        block_scales,
        ROWS=rows,
        COLS=cols,
        SCALE_STRIDE=block_scales.shape[2],
        KIND=float_kind(first.dtype),
        TRANSPOSE=transpose,
        BLOCK=FP8_BLOCK,
        ROWS_PER_PASS=config.block_rows,
        num_warps=config.num_warps,
    )
    return FP8StackedWeights(data, block_scales)


def sm90_specs(variant: BuildVariant, config: TileConfig = DEFAULT_CONFIG,
               transpose: Optional[bool] = None) -> List[KernelSpec]:
    """The kernel for a weight [2 x 2048, hidden] (fc1's shape), as sm90_build compiles it;
    transposed (unless told) when the variant's ceil_rule is off, so that both variants build."""
    rows = 2 * 2048
    transpose = not variant.ceil_rule if transpose is None else transpose
    return [KernelSpec(
        "quantize_fp8_weight", _quantize_fp8_weight_kernel,
        {"w_addresses_ptr": "*i64", "out_words_ptr": "*i32", "scales_ptr": "*fp32"},
        {"ROWS": rows, "COLS": variant.hidden, "SCALE_STRIDE": padded_scale_columns(variant.hidden),
         "KIND": variant.input_kind, "TRANSPOSE": transpose, "BLOCK": FP8_BLOCK, "ROWS_PER_PASS": config.block_rows},
        config.num_warps, FP8_BLOCK * FP8_BLOCK)]
