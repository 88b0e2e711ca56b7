"""BF16 / FP16 / FP32 rows of ragged expert segments -> X^T in FP8 E4M3 with 1x128 blocks along
tokens: the gradient operand of the expert wgrad GEMM, written in one launch (read in one or two
passes over each 128-token block, by tile config).

Each 128-token block of an expert's segment takes, per hidden column, the smallest power-of-two
scale with amax / scale <= 448 (never below 2^-126), as the row quantizer does along rows. A block
column holding NaN / Inf gets a NaN scale and NaN data. Segments start at multiples of 128
columns and are zero past their last token (`_segments.py`); counts stay on the device.
"""

from typing import List, Optional

import torch
import triton
import triton.language as tl

from ..formats import FP8_BLOCK
from ..tensors import COLWISE, FP8BlockTensor
from ._bits import abs_max4, e4m3_word, fp8_block_scale
from ._checks import TileConfig, check_float_matrix, check_rows_per_pass, float_kind, launch_config, quad_ready
from ._format_constants import E4M3_NAN
from ._segments import block_rows, check_segments, empty_colwise, experts_pow2
from ._sm90_spec import EXPERTS_POW2, BuildVariant, KernelSpec
from ._transposed_tiles import load_slice, quad_columns, store_column_words

# block_cols counts quads of hidden columns (4 each); block_rows is the tokens per pass over the
# 128-token FP8 block: 128 holds the block in registers, fewer read it twice (an amax pass, then a
# convert pass from L2) with fewer registers and wider programs. Each candidate gives a thread at
# least two quads of a slice (block_rows / 4 x block_cols >= 2 x threads), so loads stay 16-byte
# vectors. Fully unrolled, the two-pass candidates issue 17-19 SASS instructions per element
# against 24 for one pass (whose 128-row reductions take more shuffles), but rely on the re-read
# hitting L2. The sweep's candidates (benchmarks/bench_quantizers.py, its rows); the default (first)
# was the fastest on H200 at 16384 x 7168, 32 ragged experts, in two sweeps (67.2% of the copy; 32x32
# on 4 warps 63.8%, 16x64 on 4 warps 22.5%, one pass (kept as the reference) 45.8%; 64x32 and 32x64
# on 8 warps 53.2% and 48.7%, 64x8 on 2 warps 63.3%, 64x16 on 4 64.2%, 32x8 on 1 61.0%, 16x32 on 2
# 23.0%, dropped).
CONFIGS = (
    TileConfig(block_rows=32, block_cols=16, num_warps=2),
    TileConfig(block_rows=32, block_cols=32, num_warps=4),
    TileConfig(block_rows=16, block_cols=64, num_warps=4),
    TileConfig(block_rows=FP8_BLOCK, block_cols=16, num_warps=8),
)
DEFAULT_CONFIG = CONFIGS[0]
# Under the interpreter a program costs about the same whatever its size: one pass over 128 tokens x
# 512 columns (8 times the one-pass candidate's columns; 5x faster at 512 x 512).
INTERPRETER_CONFIG = TileConfig(block_rows=FP8_BLOCK, block_cols=128, num_warps=8)


@triton.jit
def _quantize_fp8_cols_kernel(
    x_pairs_ptr,  # [num_rows, HIDDEN / 2] pairs of elements (see _bits.load_float_quads)
    out_words_ptr,  # int32 view of X^T [HIDDEN, capacity]
    scales_ptr,  # fp32 [capacity / 128, HIDDEN]
    counts_ptr,
    segment_offsets_ptr,  # int64 [E + 1], written by program (0, 0)
    num_rows,
    num_experts,
    out_row_stride,  # capacity / 4: int32 words per row of X^T
    HIDDEN: tl.constexpr,
    KIND: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    TOKENS: tl.constexpr,  # 128
    BLOCK_QUADS: tl.constexpr,  # quads of hidden columns per program
    TOKENS_PER_PASS: tl.constexpr,  # TOKENS: one pass
):
    column_start = tl.program_id(0) * TOKENS
    first_row, valid_rows = block_rows(counts_ptr, segment_offsets_ptr, num_experts, column_start, EXPERTS_POW2,
                                       TOKENS)
    quad = tl.program_id(1) * BLOCK_QUADS + tl.arange(0, BLOCK_QUADS)
    if HIDDEN % (4 * BLOCK_QUADS) == 0:
        quad_ok = None  # whole tiles: no column masks
    else:
        quad_ok = quad < HIDDEN // 4
    word_start = tl.program_id(0) * (TOKENS // 4)
    a, b, c, d = _load_tokens(x_pairs_ptr, first_row, valid_rows, num_rows, 0, quad, quad_ok, HIDDEN, KIND,
                              TOKENS_PER_PASS)
    if TOKENS_PER_PASS == TOKENS:
        # One pass: the block stays in registers from its amax to its FP8 words.
        scale, inv_scale, is_nan = fp8_block_scale(tl.max(abs_max4(a, b, c, d), axis=0))  # per column [Q, 2, 2]
        _store_tokens(out_words_ptr, a, b, c, d, inv_scale, is_nan, quad, quad_ok, word_start, out_row_stride)
    else:
        # An amax pass keeping only the running elementwise max, then a convert pass that reads the
        # block again (from L2): fewer registers for wider tiles.
        amax = abs_max4(a, b, c, d)
        for t in range(TOKENS_PER_PASS, TOKENS, TOKENS_PER_PASS):
            a, b, c, d = _load_tokens(x_pairs_ptr, first_row, valid_rows, num_rows, t, quad, quad_ok, HIDDEN, KIND,
                                      TOKENS_PER_PASS)
            amax = tl.maximum(amax, abs_max4(a, b, c, d))
        scale, inv_scale, is_nan = fp8_block_scale(tl.max(amax, axis=0))
        for t in range(0, TOKENS, TOKENS_PER_PASS):
            a, b, c, d = _load_tokens(x_pairs_ptr, first_row, valid_rows, num_rows, t, quad, quad_ok, HIDDEN, KIND,
                                      TOKENS_PER_PASS)
            _store_tokens(out_words_ptr, a, b, c, d, inv_scale, is_nan, quad, quad_ok, word_start + t // 4,
                          out_row_stride)
    scale_offsets = tl.program_id(0).to(tl.int64) * HIDDEN + quad_columns(quad)
    if quad_ok is None:
        tl.store(scales_ptr + scale_offsets, scale)
    else:
        tl.store(scales_ptr + scale_offsets, scale, mask=quad_ok[:, None, None])


@triton.jit
def _load_tokens(x_pairs_ptr, first_row, valid_rows, num_rows, t, quad, quad_ok, HIDDEN: tl.constexpr,
                 KIND: tl.constexpr, TOKENS_PER_PASS: tl.constexpr):
    """Tokens t .. t + TOKENS_PER_PASS of the block as four slices, slice k holding tokens t + 4j + k
    (_transposed_tiles); tokens past the segment (and rows outside the input) read as 0."""
    token = t + 4 * tl.arange(0, TOKENS_PER_PASS // 4)
    rows = first_row + token
    ok = (token < valid_rows) & (rows >= 0) & (rows < num_rows)
    a = load_slice(x_pairs_ptr, rows, ok, quad, quad_ok, HIDDEN // 4, KIND)
    ok = (token + 1 < valid_rows) & (rows + 1 >= 0) & (rows + 1 < num_rows)
    b = load_slice(x_pairs_ptr, rows + 1, ok, quad, quad_ok, HIDDEN // 4, KIND)
    ok = (token + 2 < valid_rows) & (rows + 2 >= 0) & (rows + 2 < num_rows)
    c = load_slice(x_pairs_ptr, rows + 2, ok, quad, quad_ok, HIDDEN // 4, KIND)
    ok = (token + 3 < valid_rows) & (rows + 3 >= 0) & (rows + 3 < num_rows)
    d = load_slice(x_pairs_ptr, rows + 3, ok, quad, quad_ok, HIDDEN // 4, KIND)
    return a, b, c, d


@triton.jit
def _store_tokens(out_words_ptr, a, b, c, d, inv_scale, is_nan, quad, quad_ok, word_start, out_row_stride):
    words = tl.where(is_nan[None], E4M3_NAN * 0x01010101, e4m3_word(a, b, c, d, inv_scale[None]))
    store_column_words(out_words_ptr, words, quad, quad_ok, word_start, out_row_stride)


def quantize_fp8_cols(
    x: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    capacity=None,
    check_counts: bool = True,
    config: Optional[TileConfig] = None,
) -> FP8BlockTensor:
    """x [T, H] (bf16, fp16 or fp32; H a multiple of 128), rows = the experts' tokens back to back
    -> X^T [H, capacity] in FP8 with 1x128 blocks along tokens, colwise with segment offsets.

    tokens_per_expert: int32/int64 [E] on x's device (no host sync); capacity defaults to
    colwise_capacity(T, E); check_counts as in mxfp4_to_fp8_cols; config: see _checks.launch_config."""
    check_float_matrix("quantize_fp8_cols", x, FP8_BLOCK)
    config = launch_config(config, x.device, DEFAULT_CONFIG, INTERPRETER_CONFIG)
    check_rows_per_pass("quantize_fp8_cols", config.block_rows, FP8_BLOCK)
    num_rows, hidden = x.shape
    capacity = check_segments("quantize_fp8_cols", tokens_per_expert, x.device, num_rows, capacity, check_counts)
    num_experts = tokens_per_expert.numel()
    segment_offsets, data, block_scales = empty_colwise(hidden, capacity, num_experts, x.device)
    grid = (capacity // FP8_BLOCK, triton.cdiv(hidden // 4, config.block_cols))
    _quantize_fp8_cols_kernel[grid](
        quad_ready(x),
        data.view(torch.int32),
        block_scales,
        tokens_per_expert,
        segment_offsets,
        num_rows,
        num_experts,
        capacity // 4,
        HIDDEN=hidden,
        KIND=float_kind(x.dtype),
        EXPERTS_POW2=experts_pow2(tokens_per_expert),
        TOKENS=FP8_BLOCK,
        BLOCK_QUADS=config.block_cols,
        TOKENS_PER_PASS=config.block_rows,
        num_warps=config.num_warps,
    )
    return FP8BlockTensor(data, block_scales, COLWISE, segment_offsets)


def sm90_specs(variant: BuildVariant, config: TileConfig = DEFAULT_CONFIG) -> List[KernelSpec]:
    """The kernel at a tile config (the default one unless given), as sm90_build compiles it."""
    return [KernelSpec(
        "quantize_fp8_cols", _quantize_fp8_cols_kernel,
        {"x_pairs_ptr": variant.pairs_pointer, "out_words_ptr": "*i32", "scales_ptr": "*fp32", "counts_ptr": "*i64",
         "segment_offsets_ptr": "*i64", "num_rows": "i32", "num_experts": "i32", "out_row_stride": "i32"},
        {"HIDDEN": variant.hidden, "KIND": variant.input_kind, "EXPERTS_POW2": EXPERTS_POW2, "TOKENS": FP8_BLOCK,
         "BLOCK_QUADS": config.block_cols, "TOKENS_PER_PASS": config.block_rows},
        config.num_warps, FP8_BLOCK * config.block_cols * 4)]
