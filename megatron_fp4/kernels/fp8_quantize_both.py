"""BF16 / FP16 / FP32 rows of ragged expert segments -> FP8 E4M3 twice from one read: 1x128 blocks
along each row (quantize_fp8_rows' output) and 1x128 blocks along each segment's tokens, transposed
(quantize_fp8_cols' output), in one launch.

A backward GEMM pair reads the same gradient both ways: the data gradient takes it in rows, the
weight gradient in columns. Two quantizers read it twice; here each program holds one 128-token
block of a segment by 128 columns (one row group wide, so both blocks' amaxes are complete in the
program) and writes both encodings. The bits are the two quantizers' (same scale rule, same
rounding, NaN / Inf blocks NaN): tests/ops pin them to the reference.
"""

from typing import List, Optional, Tuple

import torch
import triton
import triton.language as tl

from ..formats import FP8_BLOCK
from ..tensors import COLWISE, ROWWISE, FP8BlockTensor
from ._bits import abs_max4, e4m3_word, fp8_block_scale, load_float_quads
from ._checks import TileConfig, check_float_matrix, float_kind, quad_ready
from ._format_constants import E4M3_NAN
from ._segments import block_rows, check_segments, empty_colwise, experts_pow2
from ._sm90_spec import EXPERTS_POW2, BuildVariant, KernelSpec

QUADS = FP8_BLOCK // 4  # a program's columns, in quads: one row group
# A program is one 128-token block by one row group; only its warps vary (benchmarks/bench_quantizers.py
# sweeps them, the first is the default). Compiled for sm_90 (benchmarks/kernel_sass_stats.py) 16 warps
# take 82 registers a thread and 38 SASS instructions per element, 8 warps 172 and 31: one program per
# SM either way.
CONFIGS = (
    TileConfig(block_rows=FP8_BLOCK, block_cols=QUADS, num_warps=16),
    TileConfig(block_rows=FP8_BLOCK, block_cols=QUADS, num_warps=8),
)
DEFAULT_CONFIG = CONFIGS[0]


@triton.jit
def _token_slice(x_pairs_ptr, first_row, valid_rows, num_rows, k, quad, HIDDEN: tl.constexpr, KIND: tl.constexpr,
                 TOKENS: tl.constexpr):
    """Tokens k, k + 4, ..., k + TOKENS - 4 of the block by the program's quads: four [TOKENS / 4, QUADS]
    fp32 bit patterns (columns 4q .. 4q + 3), their input rows and which are real; tokens past the
    segment (and rows outside the input) read as 0."""
    token = k + 4 * tl.arange(0, TOKENS // 4)
    rows = first_row + token
    ok = (token < valid_rows) & (rows >= 0) & (rows < num_rows)
    offsets = rows[:, None].to(tl.int64) * (HIDDEN // 4) + quad[None, :]
    e0, e1, e2, e3 = load_float_quads(x_pairs_ptr, offsets, ok[:, None], KIND)
    return e0, e1, e2, e3, rows, ok


@triton.jit
def _store_row_words(rows_words_ptr, rows_scales_ptr, e0, e1, e2, e3, rows, ok, quad, group, num_rows,
                     HIDDEN: tl.constexpr):
    """One token slice's row blocks (128 columns each, one per token): scale, FP8 words, scales."""
    scale, inv_scale, is_nan = fp8_block_scale(tl.max(abs_max4(e0, e1, e2, e3), axis=1))
    words = tl.where(is_nan[:, None], E4M3_NAN * 0x01010101, e4m3_word(e0, e1, e2, e3, inv_scale[:, None]))
    offsets = rows[:, None].to(tl.int64) * (HIDDEN // 4) + quad[None, :]
    tl.store(rows_words_ptr + offsets, words, mask=ok[:, None])
    tl.store(rows_scales_ptr + group.to(tl.int64) * num_rows + rows, scale, mask=ok)


@triton.jit
def _store_column_words(cols_words_ptr, cols_scales_ptr, t0, t1, t2, t3, column, word_start, scale_start,
                        out_row_stride):
    """Column `column` [QUADS] of the four token slices (tokens 4j .. 4j + 3 at [j]): its 128-token
    block's scale, four tokens' FP8 bytes per word of the transposed row, and the scale."""
    amax = tl.max(abs_max4(t0, t1, t2, t3), axis=0)
    scale, inv_scale, is_nan = fp8_block_scale(amax)
    words = tl.where(is_nan[None, :], E4M3_NAN * 0x01010101, e4m3_word(t0, t1, t2, t3, inv_scale[None, :]))
    word = word_start + tl.arange(0, t0.shape[0])
    tl.store(cols_words_ptr + column[None, :].to(tl.int64) * out_row_stride + word[:, None], words)
    tl.store(cols_scales_ptr + scale_start + column, scale)


@triton.jit
def _quantize_fp8_both_kernel(
    x_pairs_ptr,  # [num_rows, HIDDEN / 2] pairs of elements (see _bits.load_float_quads)
    rows_words_ptr,  # int32 view of the rowwise FP8 data [num_rows, HIDDEN]
    rows_scales_ptr,  # fp32 [HIDDEN / 128, num_rows]
    cols_words_ptr,  # int32 view of X^T [HIDDEN, capacity]
    cols_scales_ptr,  # fp32 [capacity / 128, HIDDEN]
    counts_ptr,
    segment_offsets_ptr,  # int64 [E + 1], written by program (0, 0)
    num_rows,
    num_experts,
    out_row_stride,  # capacity / 4: int32 words per row of X^T
    HIDDEN: tl.constexpr,
    KIND: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    TOKENS: tl.constexpr,  # 128
    QUADS: tl.constexpr,  # 32: one row group
):
    block = tl.program_id(0)
    group = tl.program_id(1)
    first_row, valid_rows = block_rows(counts_ptr, segment_offsets_ptr, num_experts, block * TOKENS, EXPERTS_POW2,
                                       TOKENS)
    quad = group * QUADS + tl.arange(0, QUADS)
    # Slice k holds tokens 4j + k; each of its e_i holds column 4q + i.
    a0, a1, a2, a3, rows_a, ok_a = _token_slice(x_pairs_ptr, first_row, valid_rows, num_rows, 0, quad, HIDDEN, KIND,
                                                TOKENS)
    b0, b1, b2, b3, rows_b, ok_b = _token_slice(x_pairs_ptr, first_row, valid_rows, num_rows, 1, quad, HIDDEN, KIND,
                                                TOKENS)
    c0, c1, c2, c3, rows_c, ok_c = _token_slice(x_pairs_ptr, first_row, valid_rows, num_rows, 2, quad, HIDDEN, KIND,
                                                TOKENS)
    d0, d1, d2, d3, rows_d, ok_d = _token_slice(x_pairs_ptr, first_row, valid_rows, num_rows, 3, quad, HIDDEN, KIND,
                                                TOKENS)
    _store_row_words(rows_words_ptr, rows_scales_ptr, a0, a1, a2, a3, rows_a, ok_a, quad, group, num_rows, HIDDEN)
    _store_row_words(rows_words_ptr, rows_scales_ptr, b0, b1, b2, b3, rows_b, ok_b, quad, group, num_rows, HIDDEN)
    _store_row_words(rows_words_ptr, rows_scales_ptr, c0, c1, c2, c3, rows_c, ok_c, quad, group, num_rows, HIDDEN)
    _store_row_words(rows_words_ptr, rows_scales_ptr, d0, d1, d2, d3, rows_d, ok_d, quad, group, num_rows, HIDDEN)
    word_start = block * (TOKENS // 4)
    scale_start = block.to(tl.int64) * HIDDEN
    column = 4 * quad
    _store_column_words(cols_words_ptr, cols_scales_ptr, a0, b0, c0, d0, column, word_start, scale_start,
                        out_row_stride)
    _store_column_words(cols_words_ptr, cols_scales_ptr, a1, b1, c1, d1, column + 1, word_start, scale_start,
                        out_row_stride)
    _store_column_words(cols_words_ptr, cols_scales_ptr, a2, b2, c2, d2, column + 2, word_start, scale_start,
                        out_row_stride)
    _store_column_words(cols_words_ptr, cols_scales_ptr, a3, b3, c3, d3, column + 3, word_start, scale_start,
                        out_row_stride)


def quantize_fp8_rows_and_cols(x: torch.Tensor, tokens_per_expert: torch.Tensor, capacity=None,
                               check_counts: bool = True, config: Optional[TileConfig] = None,
                               ) -> Tuple[FP8BlockTensor, FP8BlockTensor]:
    """x [T, H] (bf16, fp16 or fp32; H a multiple of 128), rows = the experts' tokens back to back
    -> (quantize_fp8_rows(x), quantize_fp8_cols(x, tokens_per_expert, capacity)), the same bits,
    from one read of x. Arguments as quantize_fp8_cols'; config: one of CONFIGS' shape (128 tokens by
    32 quads), any warps; default DEFAULT_CONFIG."""
    check_float_matrix("quantize_fp8_rows_and_cols", x, FP8_BLOCK)
    config = DEFAULT_CONFIG if config is None else config
    if (config.block_rows, config.block_cols) != (FP8_BLOCK, QUADS):
        raise ValueError(f"quantize_fp8_rows_and_cols: a program is {FP8_BLOCK} tokens by {QUADS} quads, got "
                         f"config {config}")
    num_rows, hidden = x.shape
    capacity = check_segments("quantize_fp8_rows_and_cols", tokens_per_expert, x.device, num_rows, capacity,
                              check_counts)
    num_experts = tokens_per_expert.numel()
    rows_data = torch.empty(num_rows, hidden, dtype=torch.float8_e4m3fn, device=x.device)
    rows_scales = torch.empty(hidden // FP8_BLOCK, num_rows, dtype=torch.float32, device=x.device)
    segment_offsets, cols_data, cols_scales = empty_colwise(hidden, capacity, num_experts, x.device)
    _quantize_fp8_both_kernel[(capacity // FP8_BLOCK, hidden // FP8_BLOCK)](
        quad_ready(x),
        rows_data.view(torch.int32),
        rows_scales,
        cols_data.view(torch.int32),
        cols_scales,
        tokens_per_expert,
        segment_offsets,
        num_rows,
        num_experts,
        capacity // 4,
        HIDDEN=hidden,
        KIND=float_kind(x.dtype),
        EXPERTS_POW2=experts_pow2(tokens_per_expert),
        TOKENS=FP8_BLOCK,
        QUADS=QUADS,
        num_warps=config.num_warps,
    )
    return (FP8BlockTensor(rows_data, rows_scales, ROWWISE),
            FP8BlockTensor(cols_data, cols_scales, COLWISE, segment_offsets))


def sm90_specs(variant: BuildVariant, config: TileConfig = DEFAULT_CONFIG) -> List[KernelSpec]:
    """The kernel at a config (the default one unless given), as sm90_build compiles it."""
    return [KernelSpec(
        "quantize_fp8_rows_and_cols", _quantize_fp8_both_kernel,
        {"x_pairs_ptr": variant.pairs_pointer, "rows_words_ptr": "*i32", "rows_scales_ptr": "*fp32",
         "cols_words_ptr": "*i32", "cols_scales_ptr": "*fp32", "counts_ptr": "*i64", "segment_offsets_ptr": "*i64",
         "num_rows": "i32", "num_experts": "i32", "out_row_stride": "i32"},
        {"HIDDEN": variant.hidden, "KIND": variant.input_kind, "EXPERTS_POW2": EXPERTS_POW2, "TOKENS": FP8_BLOCK,
         "QUADS": QUADS},
        config.num_warps, FP8_BLOCK * FP8_BLOCK)]
