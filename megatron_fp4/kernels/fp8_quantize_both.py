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
from ._checks import TileConfig, check_float_matrix, check_rows_per_pass, float_kind, launch_config, quad_ready
from ._format_constants import E4M3_NAN
from ._segments import block_rows, check_segments, empty_colwise, experts_pow2
from ._sm90_spec import EXPERTS_POW2, BuildVariant, KernelSpec

QUADS = FP8_BLOCK // 4  # a program's columns, in quads: one row group
# A program is one 128-token block by one row group. block_rows is the tokens per pass: 128 keeps the
# block in registers from its loads to both stores; fewer make two passes, the first quantizing and
# storing the rows and keeping each column's running amax, the second reading the block again (from
# L2) for the columns: fewer registers a thread, more programs an SM. The sweep's candidates
# (benchmarks/bench_quantizers.py); compiled for sm_90 (benchmarks/kernel_sass_stats.py --candidates),
# the one-pass tile takes 82 registers a thread on 16 warps and 170 on 8 (one program an SM), the
# others 78-79. The default, 64 tokens a pass on 8 warps, was the fastest at both sizes of the H100
# sweep (32768 tokens over 8 experts, 7168 and 4096 columns: 64% and 65% of the copy's bandwidth;
# 32 tokens on 4 warps 63% and 64%, one pass 43-49%, 16 tokens 32%).
CONFIGS = (
    TileConfig(block_rows=64, block_cols=QUADS, num_warps=8),
    TileConfig(block_rows=32, block_cols=QUADS, num_warps=4),
    TileConfig(block_rows=16, block_cols=QUADS, num_warps=2),
    TileConfig(block_rows=FP8_BLOCK, block_cols=QUADS, num_warps=16),
    TileConfig(block_rows=FP8_BLOCK, block_cols=QUADS, num_warps=8),
)
DEFAULT_CONFIG = CONFIGS[0]
# Under the interpreter a program's cost is per pass and per operation: one pass.
INTERPRETER_CONFIG = TileConfig(block_rows=FP8_BLOCK, block_cols=QUADS, num_warps=8)


@triton.jit
def _token_slice(x_pairs_ptr, first_row, valid_rows, num_rows, first_token, quad, HIDDEN: tl.constexpr,
                 KIND: tl.constexpr, COUNT: tl.constexpr):
    """Tokens first_token, first_token + 4, ... (COUNT of them) of the block by the program's quads:
    four [COUNT, QUADS] fp32 bit patterns (columns 4q .. 4q + 3), their input rows and which are
    real; tokens past the segment (and rows outside the input) read as 0."""
    token = first_token + 4 * tl.arange(0, COUNT)
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
def _pass_slices(x_pairs_ptr, first_row, valid_rows, num_rows, t, quad, HIDDEN: tl.constexpr, KIND: tl.constexpr,
                 COUNT: tl.constexpr):
    """Tokens t .. t + 4 COUNT - 1 as four slices (slice k: tokens t + 4j + k), each as _token_slice
    gives it: 16 tensors (slice by slice, column i of a quad at [.., i]), then each slice's input rows
    and which are real."""
    a0, a1, a2, a3, rows_a, ok_a = _token_slice(x_pairs_ptr, first_row, valid_rows, num_rows, t, quad, HIDDEN, KIND,
                                                COUNT)
    b0, b1, b2, b3, rows_b, ok_b = _token_slice(x_pairs_ptr, first_row, valid_rows, num_rows, t + 1, quad, HIDDEN,
                                                KIND, COUNT)
    c0, c1, c2, c3, rows_c, ok_c = _token_slice(x_pairs_ptr, first_row, valid_rows, num_rows, t + 2, quad, HIDDEN,
                                                KIND, COUNT)
    d0, d1, d2, d3, rows_d, ok_d = _token_slice(x_pairs_ptr, first_row, valid_rows, num_rows, t + 3, quad, HIDDEN,
                                                KIND, COUNT)
    return (a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3,
            rows_a, rows_b, rows_c, rows_d, ok_a, ok_b, ok_c, ok_d)


@triton.jit
def _rows_of_pass(x_pairs_ptr, rows_words_ptr, rows_scales_ptr, first_row, valid_rows, num_rows, t, quad, group,
                  HIDDEN: tl.constexpr, KIND: tl.constexpr, COUNT: tl.constexpr):
    """_pass_slices' tokens with their rows quantized and stored; returns the 16 slice tensors."""
    (a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3,
     rows_a, rows_b, rows_c, rows_d, ok_a, ok_b, ok_c, ok_d) = _pass_slices(
        x_pairs_ptr, first_row, valid_rows, num_rows, t, quad, HIDDEN, KIND, COUNT)
    _store_row_words(rows_words_ptr, rows_scales_ptr, a0, a1, a2, a3, rows_a, ok_a, quad, group, num_rows, HIDDEN)
    _store_row_words(rows_words_ptr, rows_scales_ptr, b0, b1, b2, b3, rows_b, ok_b, quad, group, num_rows, HIDDEN)
    _store_row_words(rows_words_ptr, rows_scales_ptr, c0, c1, c2, c3, rows_c, ok_c, quad, group, num_rows, HIDDEN)
    _store_row_words(rows_words_ptr, rows_scales_ptr, d0, d1, d2, d3, rows_d, ok_d, quad, group, num_rows, HIDDEN)
    return a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3


@triton.jit
def _column_amax(t0, t1, t2, t3):
    """[QUADS]: the largest |x| bits of one column of a quad over four token slices."""
    return tl.max(abs_max4(t0, t1, t2, t3), axis=0)


@triton.jit
def _store_column_words(cols_words_ptr, t0, t1, t2, t3, inv_scale, is_nan, column, word_start, out_row_stride):
    """Column `column` [QUADS] of four token slices (tokens 4j .. 4j + 3 of the pass at [j]): four
    tokens' FP8 bytes per int32 word of the transposed row, words word_start + j."""
    words = tl.where(is_nan[None, :], E4M3_NAN * 0x01010101, e4m3_word(t0, t1, t2, t3, inv_scale[None, :]))
    word = word_start + tl.arange(0, t0.shape[0])
    tl.store(cols_words_ptr + column[None, :].to(tl.int64) * out_row_stride + word[:, None], words)


@triton.jit
def _store_pass_columns(cols_words_ptr, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3,
                        inv0, inv1, inv2, inv3, nan0, nan1, nan2, nan3, column, word_start, out_row_stride):
    """A pass's four columns of each quad (column + i: the slices' e_i) in FP8, words word_start + j."""
    _store_column_words(cols_words_ptr, a0, b0, c0, d0, inv0, nan0, column, word_start, out_row_stride)
    _store_column_words(cols_words_ptr, a1, b1, c1, d1, inv1, nan1, column + 1, word_start, out_row_stride)
    _store_column_words(cols_words_ptr, a2, b2, c2, d2, inv2, nan2, column + 2, word_start, out_row_stride)
    _store_column_words(cols_words_ptr, a3, b3, c3, d3, inv3, nan3, column + 3, word_start, out_row_stride)


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
    TOKENS_PER_PASS: tl.constexpr,  # TOKENS: one pass
):
    block = tl.program_id(0)
    group = tl.program_id(1)
    first_row, valid_rows = block_rows(counts_ptr, segment_offsets_ptr, num_experts, block * TOKENS, EXPERTS_POW2,
                                       TOKENS)
    quad = group * QUADS + tl.arange(0, QUADS)
    COUNT: tl.constexpr = TOKENS_PER_PASS // 4
    word_start = block * (TOKENS // 4)
    column = 4 * quad
    # Slice k of a pass holds its tokens 4j + k; each slice's e_i holds column 4q + i.
    a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3 = _rows_of_pass(
        x_pairs_ptr, rows_words_ptr, rows_scales_ptr, first_row, valid_rows, num_rows, 0, quad, group, HIDDEN, KIND,
        COUNT)
    amax0 = _column_amax(a0, b0, c0, d0)
    amax1 = _column_amax(a1, b1, c1, d1)
    amax2 = _column_amax(a2, b2, c2, d2)
    amax3 = _column_amax(a3, b3, c3, d3)
    for t in range(TOKENS_PER_PASS, TOKENS, TOKENS_PER_PASS):
        a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3 = _rows_of_pass(
            x_pairs_ptr, rows_words_ptr, rows_scales_ptr, first_row, valid_rows, num_rows, t, quad, group, HIDDEN,
            KIND, COUNT)
        amax0 = tl.maximum(amax0, _column_amax(a0, b0, c0, d0))
        amax1 = tl.maximum(amax1, _column_amax(a1, b1, c1, d1))
        amax2 = tl.maximum(amax2, _column_amax(a2, b2, c2, d2))
        amax3 = tl.maximum(amax3, _column_amax(a3, b3, c3, d3))
    scale0, inv0, nan0 = fp8_block_scale(amax0)
    scale1, inv1, nan1 = fp8_block_scale(amax1)
    scale2, inv2, nan2 = fp8_block_scale(amax2)
    scale3, inv3, nan3 = fp8_block_scale(amax3)
    if TOKENS_PER_PASS == TOKENS:
        # One pass: the block is still in registers.
        _store_pass_columns(cols_words_ptr, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3,
                            inv0, inv1, inv2, inv3, nan0, nan1, nan2, nan3, column, word_start, out_row_stride)
    else:
        for t in range(0, TOKENS, TOKENS_PER_PASS):
            (a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3,
             _, _, _, _, _, _, _, _) = _pass_slices(x_pairs_ptr, first_row, valid_rows, num_rows, t, quad, HIDDEN,
                                                    KIND, COUNT)
            _store_pass_columns(cols_words_ptr, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3,
                                inv0, inv1, inv2, inv3, nan0, nan1, nan2, nan3, column, word_start + t // 4,
                                out_row_stride)
    scales_at = cols_scales_ptr + block.to(tl.int64) * HIDDEN + column
    tl.store(scales_at, scale0)
    tl.store(scales_at + 1, scale1)
    tl.store(scales_at + 2, scale2)
    tl.store(scales_at + 3, scale3)


def quantize_fp8_rows_and_cols(x: torch.Tensor, tokens_per_expert: torch.Tensor, capacity=None,
                               check_counts: bool = True, config: Optional[TileConfig] = None,
                               ) -> Tuple[FP8BlockTensor, FP8BlockTensor]:
    """x [T, H] (bf16, fp16 or fp32; H a multiple of 128), rows = the experts' tokens back to back
    -> (quantize_fp8_rows(x), quantize_fp8_cols(x, tokens_per_expert, capacity)), the same bits,
    from one read of x in memory (two passes over each block, the second from L2, unless one pass
    takes the whole block). Arguments as quantize_fp8_cols' (with check_counts False, counts that do
    not sum to T leave the rows past their sum unwritten); config: tokens per pass (a power of two
    from 16 to 128) by 32 quads, any warps (see _checks.launch_config)."""
    check_float_matrix("quantize_fp8_rows_and_cols", x, FP8_BLOCK)
    config = launch_config(config, x.device, DEFAULT_CONFIG, INTERPRETER_CONFIG)
    if config.block_cols != QUADS:
        raise ValueError(f"quantize_fp8_rows_and_cols: a program is {QUADS} quads (one row group) wide, got "
                         f"config {config}")
    check_rows_per_pass("quantize_fp8_rows_and_cols", config.block_rows, FP8_BLOCK)
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
        TOKENS_PER_PASS=config.block_rows,
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
         "QUADS": QUADS, "TOKENS_PER_PASS": config.block_rows},
        config.num_warps, FP8_BLOCK * FP8_BLOCK)]
