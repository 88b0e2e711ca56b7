"""MXFP4 -> FP8 1x128, in the integer domain (docs/design.md §3): no BF16 or FP32 copy in memory.

Rows (the fprop operand): per token and 128-column group with scale bytes e0..e3, S = max(e_i),
each element becomes E2M1 * 2^(e_i - S + 6) in E4M3 and the group's scale is 2^(S - 133).

Columns (the wgrad operand): per expert segment and per 128-token block of it, the same with S
taken over the block's tokens for each MXFP4 block column. The kernel reads FP4 rows and writes
X^T directly; each expert's segment starts at a multiple of 128 columns, zero-filled past its last
token. Per-expert token counts stay on the device: the output is sized for the worst case.

Blocks holding NaN / Inf (byte 255) take no part in S and become E4M3 NaN.
"""

from typing import List, Optional

import torch
import triton
import triton.language as tl

from ..formats import FP8_BLOCK, MXFP4_BLOCK
from ..tensors import COLWISE, ROWWISE, FP8BlockTensor, MXFP4Tensor
from ._bits import fp4_word_to_fp8_exact, fp4_word_to_fp8_fast, fp4_words_need_exact_path, pow2_fp32
from ._checks import TileConfig, check_hidden_multiple, check_kernel_device, launch_config
from ._format_constants import E8M0_NAN, FP4_TO_FP8_SCALE_BIAS
from ._segments import block_source_rows, check_segments, empty_colwise, experts_pow2
from ._sm90_spec import EXPERTS_POW2, BuildVariant, KernelSpec

# block_cols counts 128-element groups for rows and 32-element MXFP4 blocks for columns.
DEFAULT_ROWS_CONFIG = TileConfig(block_rows=8, block_cols=8, num_warps=4)
DEFAULT_COLS_CONFIG = TileConfig(block_rows=FP8_BLOCK, block_cols=4, num_warps=4)
# Under the interpreter a program costs about the same whatever its size (launch_config): up to 1024
# hidden a program. Rows: 64 tokens, not 128, because the exact path walks its block row by row, so
# a taller block costs the hard-case tests more than it saves (replaying the rows conversions of the
# FP8-expert and training tests: 6x less time than the GPU's 8 x 8; 128 rows 10x).
INTERPRETER_ROWS_CONFIG = TileConfig(block_rows=64, block_cols=8, num_warps=4)
INTERPRETER_COLS_CONFIG = TileConfig(block_rows=FP8_BLOCK, block_cols=32, num_warps=4)

# Tokens per step of the columns kernel's exact (large-gap) path.
_EXACT_TOKENS = tl.constexpr(16)


@triton.jit
def _group_scales(scale_word):
    """The four E8M0 bytes of a group, packed in one int32 -> their largest finite byte."""
    b0 = scale_word & 0xFF
    b1 = (scale_word >> 8) & 0xFF
    b2 = (scale_word >> 16) & 0xFF
    b3 = (scale_word >> 24) & 0xFF
    b0 = tl.where(b0 == E8M0_NAN, 0, b0)
    b1 = tl.where(b1 == E8M0_NAN, 0, b1)
    b2 = tl.where(b2 == E8M0_NAN, 0, b2)
    b3 = tl.where(b3 == E8M0_NAN, 0, b3)
    return tl.maximum(tl.maximum(b0, b1), tl.maximum(b2, b3))


@triton.jit
def _row_group_tile(rows_ptr, out_ptr, row, group, num_rows, in_row_stride, GROUPS_PER_ROW: tl.constexpr,
                    EXACT: tl.constexpr):
    """Convert `row` x `group`: [R, G, 4 blocks, 4 words] of packed E2M1 -> int64 words of 8 E4M3.

    Everything runs in the layout of the data load: each word reads its group's scale word itself
    (an L1 hit) instead of taking it from a reduction. Returns 1 if the fast path met a gap it
    cannot serve (nothing is stored then). Measured on H200 this layout (50% of copy) beat one
    that keeps load and store in one layout with 8-byte loads (36%): see docs/history/kernel_notes.md."""
    sub_block = tl.arange(0, 4)[None, None, :, None]
    word = group[None, :, None, None] * 16 + sub_block * 4 + tl.arange(0, 4)[None, None, None, :]
    row4 = row[:, None, None, None].to(tl.int64)
    mask = (row4 < num_rows) & (word < GROUPS_PER_ROW * 16)
    in_row = rows_ptr + row4 * in_row_stride
    words = tl.load(in_row + word, mask=mask, other=0)
    # The four scale bytes of a group are one word, after the H/8 data words.
    scale_word = tl.load(in_row + GROUPS_PER_ROW * 16 + word // 16, mask=mask, other=0)
    scale_byte = (scale_word >> (sub_block * 8)) & 0xFF
    gap = _group_scales(scale_word) - scale_byte
    is_nan = scale_byte == E8M0_NAN
    if EXACT:
        first, second = fp4_word_to_fp8_exact(words, gap, is_nan)
        needs_exact = 0
    else:
        first, second = fp4_word_to_fp8_fast(words, gap, is_nan)
        needs_exact = tl.max(fp4_words_need_exact_path(words, gap).to(tl.int32))
    if needs_exact == 0:
        # Output word w (8 E4M3 bytes) is input word w (8 codes): one int64 store per word.
        out_words = (first.to(tl.int64) & 0xFFFFFFFF) | (second.to(tl.int64) << 32)
        tl.store(out_ptr + row4 * (GROUPS_PER_ROW * 16) + word, out_words, mask=mask)
    return needs_exact


@triton.jit
def _mxfp4_to_fp8_rows_kernel(
    rows_ptr,  # int32 view of the wire rows
    out_ptr,  # int64 view of the FP8 data
    scales_ptr,  # fp32 [groups, num_rows]
    num_rows,
    in_row_stride,  # in int32 words
    GROUPS_PER_ROW: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
):
    first_row = tl.program_id(0) * BLOCK_ROWS
    row = first_row + tl.arange(0, BLOCK_ROWS)
    group = tl.program_id(1) * BLOCK_GROUPS + tl.arange(0, BLOCK_GROUPS)

    group_mask = (row[:, None] < num_rows) & (group[None, :] < GROUPS_PER_ROW)
    scale_word = tl.load(rows_ptr + row[:, None].to(tl.int64) * in_row_stride + GROUPS_PER_ROW * 16 + group[None, :],
                         mask=group_mask, other=0)
    scale = pow2_fp32(_group_scales(scale_word) - FP4_TO_FP8_SCALE_BIAS)
    tl.store(scales_ptr + group[None, :].to(tl.int64) * num_rows + row[:, None], scale, mask=group_mask)

    if _row_group_tile(rows_ptr, out_ptr, row, group, num_rows, in_row_stride, GROUPS_PER_ROW, False) != 0:
        # Rare: a gap over 11 (E4M3 subnormals). Row by row keeps this path's registers from
        # lowering the occupancy of the fast one.
        for r in range(BLOCK_ROWS):
            _row_group_tile(rows_ptr, out_ptr, first_row + r + tl.arange(0, 1), group, num_rows, in_row_stride,
                            GROUPS_PER_ROW, True)


def _check_mxfp4(name: str, q: MXFP4Tensor) -> None:
    """The converters read the wire rows as int32 words: hidden a multiple of 128 makes a row
    17 * hidden / 32 bytes, a multiple of 4; the buffer and its row stride must keep that."""
    if not isinstance(q, MXFP4Tensor):
        raise TypeError(f"{name}: expected an MXFP4Tensor, got {type(q).__name__}")
    check_hidden_multiple(name, q.hidden, FP8_BLOCK)
    check_kernel_device(name, q.rows)
    if q.rows.data_ptr() % 4 or q.rows.stride(0) % 4:
        raise ValueError(f"{name}: the MXFP4 rows must start at a 4-byte boundary with a row stride divisible by 4")


def mxfp4_to_fp8_rows(q: MXFP4Tensor, config: Optional[TileConfig] = None) -> FP8BlockTensor:
    """MXFP4 [T, H] -> FP8 [T, H] with 1x128 scales along H (hidden a multiple of 128)."""
    _check_mxfp4("mxfp4_to_fp8_rows", q)
    config = launch_config(config, q.device, DEFAULT_ROWS_CONFIG, INTERPRETER_ROWS_CONFIG)
    num_rows, hidden = q.shape
    groups = hidden // FP8_BLOCK
    data = torch.empty(num_rows, hidden, dtype=torch.float8_e4m3fn, device=q.device)
    block_scales = torch.empty(groups, num_rows, dtype=torch.float32, device=q.device)
    if num_rows:
        grid = (triton.cdiv(num_rows, config.block_rows), triton.cdiv(groups, config.block_cols))
        _mxfp4_to_fp8_rows_kernel[grid](
            q.rows.view(torch.int32),
            data.view(torch.int64),
            block_scales,
            num_rows,
            q.rows.stride(0) // 4,
            GROUPS_PER_ROW=groups,
            BLOCK_ROWS=config.block_rows,
            BLOCK_GROUPS=config.block_cols,
            num_warps=config.num_warps,
        )
    return FP8BlockTensor(data, block_scales, ROWWISE)


@triton.jit
def _load_token_chunk(rows_ptr, source_row, valid, block, in_row_stride, BLOCKS_PER_ROW: tl.constexpr):
    """Packed words [C, B, 4] of C tokens x B MXFP4 blocks, each word's scale byte, and the mask."""
    mask = valid[:, None, None] & (block < BLOCKS_PER_ROW)[None, :, None]
    in_row = rows_ptr + source_row[:, None, None] * in_row_stride
    word = block[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]
    words = tl.load(in_row + word, mask=mask, other=0)
    # Scale bytes: 4 per word after the BLOCKS_PER_ROW * 4 data words.
    scale_word = tl.load(in_row + BLOCKS_PER_ROW * 4 + word // 16, mask=mask, other=0)
    scale_byte = (scale_word >> ((block[None, :, None] % 4) * 8)) & 0xFF
    return words, scale_byte


@triton.jit
def _store_columns(out_words_ptr, first, second, word_index, column_start, capacity_words, hidden_limit,
                   TOKENS: tl.constexpr, WORDS: tl.constexpr):
    """first / second [TOKENS, WORDS]: per token, the E4M3 bytes of hidden 8w..8w+3 / 8w+4..8w+7.
    Four tokens at a time, the bytes are transposed in registers so that each store writes one
    int32 of four consecutive tokens into a row of X^T."""
    quad = tl.arange(0, TOKENS // 4)
    for half in tl.static_range(2):
        if half == 0:
            words = first
        else:
            words = second
        quads = tl.permute(tl.reshape(words, (TOKENS // 4, 4, WORDS)), (2, 0, 1))  # [W, quads, 4]
        even, odd = tl.split(tl.reshape(quads, (WORDS, TOKENS // 4, 2, 2)))
        t0, t2 = tl.split(even)
        t1, t3 = tl.split(odd)
        for k in tl.static_range(4):
            column = (((t0 >> (8 * k)) & 0xFF) | (((t1 >> (8 * k)) & 0xFF) << 8)
                      | (((t2 >> (8 * k)) & 0xFF) << 16) | ((t3 >> (8 * k)) << 24))
            hidden = 8 * word_index + 4 * half + k
            offsets = hidden[:, None].to(tl.int64) * capacity_words + column_start // 4 + quad[None, :]
            tl.store(out_words_ptr + offsets, column, mask=(hidden < hidden_limit)[:, None])


@triton.jit
def _mxfp4_to_fp8_cols_kernel(
    rows_ptr,  # int32 view of the wire rows
    out_words_ptr,  # int32 view of X^T [hidden, capacity]
    scales_ptr,  # fp32 [capacity / 128, hidden]
    counts_ptr,  # [E] tokens per expert (int32 or int64)
    segment_offsets_ptr,  # int64 [E + 1], written by program (0, 0): 128-aligned segment starts
    num_rows,
    num_experts,
    capacity,
    in_row_stride,  # in int32 words
    BLOCKS_PER_ROW: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    TOKENS: tl.constexpr,  # 128: one FP8 block along tokens
    BLOCK_COLS: tl.constexpr,  # MXFP4 blocks of hidden per program
):
    column_start = tl.program_id(0) * TOKENS
    first_row, valid_rows, source_row, valid = block_source_rows(
        counts_ptr, segment_offsets_ptr, num_experts, num_rows, column_start, EXPERTS_POW2, TOKENS)
    block = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    words, scale_byte = _load_token_chunk(rows_ptr, source_row, valid, block, in_row_stride, BLOCKS_PER_ROW)
    # S of each MXFP4 block column: the largest finite byte over the 128 tokens.
    group_max = tl.max(tl.max(tl.where(scale_byte == E8M0_NAN, 0, scale_byte), axis=2), axis=0)  # [BLOCK_COLS]
    gap = group_max[None, :, None] - scale_byte
    is_nan = scale_byte == E8M0_NAN

    word_index = tl.program_id(1) * BLOCK_COLS * 4 + tl.arange(0, BLOCK_COLS * 4)
    hidden_limit = BLOCKS_PER_ROW * 32
    capacity_words = capacity // 4
    if tl.max(fp4_words_need_exact_path(words, gap).to(tl.int32)) == 0:
        first, second = fp4_word_to_fp8_fast(words, gap, is_nan)
        _store_columns(out_words_ptr, tl.reshape(first, (TOKENS, BLOCK_COLS * 4)),
                       tl.reshape(second, (TOKENS, BLOCK_COLS * 4)), word_index, column_start, capacity_words,
                       hidden_limit, TOKENS, BLOCK_COLS * 4)
    else:
        # Rare: a gap over 11 (E4M3 subnormals). 16 tokens at a time keeps this path's registers
        # from lowering the occupancy of the fast one.
        for t in range(0, TOKENS, _EXACT_TOKENS):
            chunk = t + tl.arange(0, _EXACT_TOKENS)
            chunk_row = (first_row + chunk).to(tl.int64)
            chunk_valid = (chunk < valid_rows) & (chunk_row >= 0) & (chunk_row < num_rows)
            chunk_words, chunk_bytes = _load_token_chunk(rows_ptr, chunk_row, chunk_valid, block, in_row_stride,
                                                         BLOCKS_PER_ROW)
            first_c, second_c = fp4_word_to_fp8_exact(chunk_words, group_max[None, :, None] - chunk_bytes,
                                                      chunk_bytes == E8M0_NAN)
            _store_columns(out_words_ptr, tl.reshape(first_c, (_EXACT_TOKENS, BLOCK_COLS * 4)),
                           tl.reshape(second_c, (_EXACT_TOKENS, BLOCK_COLS * 4)), word_index, column_start + t,
                           capacity_words, hidden_limit, _EXACT_TOKENS, BLOCK_COLS * 4)

    scale = pow2_fp32(group_max - FP4_TO_FP8_SCALE_BIAS)  # [BLOCK_COLS]
    scale_per_column = tl.reshape(tl.broadcast_to(scale[:, None], (BLOCK_COLS, 32)), (BLOCK_COLS * 32,))
    hidden_index = tl.program_id(1) * BLOCK_COLS * 32 + tl.arange(0, BLOCK_COLS * 32)
    scale_offsets = tl.program_id(0).to(tl.int64) * hidden_limit + hidden_index
    tl.store(scales_ptr + scale_offsets, scale_per_column, mask=hidden_index < hidden_limit)


def mxfp4_to_fp8_cols(
    q: MXFP4Tensor,
    tokens_per_expert: torch.Tensor,
    capacity: Optional[int] = None,
    check_counts: bool = True,
    config: Optional[TileConfig] = None,
) -> FP8BlockTensor:
    """MXFP4 rows of E ragged expert segments -> X^T [H, capacity] in FP8, 1x128 along tokens.

    tokens_per_expert: int32/int64 [E] on q's device (read on the device, no host sync); rows
    of q are the experts' tokens back to back. capacity defaults to colwise_capacity(T, E), the
    most the 128-aligned segments can take. check_counts: assert on the device (no host sync,
    a few small launches) that the counts are non-negative and sum to T; a caller whose counts
    come from Megatron's router may skip it. Bad counts never make the kernel read or write
    out of bounds."""
    _check_mxfp4("mxfp4_to_fp8_cols", q)
    config = launch_config(config, q.device, DEFAULT_COLS_CONFIG, INTERPRETER_COLS_CONFIG)
    num_rows, hidden = q.shape
    capacity = check_segments("mxfp4_to_fp8_cols", tokens_per_expert, q.device, num_rows, capacity, check_counts)
    num_experts = tokens_per_expert.numel()
    segment_offsets, data, block_scales = empty_colwise(hidden, capacity, num_experts, q.device)
    blocks_per_row = hidden // MXFP4_BLOCK
    grid = (capacity // FP8_BLOCK, triton.cdiv(blocks_per_row, config.block_cols))
    _mxfp4_to_fp8_cols_kernel[grid](
        q.rows.view(torch.int32),
        data.view(torch.int32),
        block_scales,
        tokens_per_expert,
        segment_offsets,
        num_rows,
        num_experts,
        capacity,
        q.rows.stride(0) // 4,
        BLOCKS_PER_ROW=blocks_per_row,
        EXPERTS_POW2=experts_pow2(tokens_per_expert),
        TOKENS=FP8_BLOCK,
        BLOCK_COLS=config.block_cols,
        num_warps=config.num_warps,
    )
    return FP8BlockTensor(data, block_scales, COLWISE, segment_offsets)


def sm90_specs(variant: BuildVariant) -> List[KernelSpec]:
    """Both kernels at their default configs, as sm90_build compiles them."""
    c = DEFAULT_COLS_CONFIG
    return [
        KernelSpec.tiled("mxfp4_to_fp8_rows", _mxfp4_to_fp8_rows_kernel,
                         {"rows_ptr": "*i32", "out_ptr": "*i64", "scales_ptr": "*fp32", "num_rows": "i32",
                          "in_row_stride": "i32"},
                         {"GROUPS_PER_ROW": variant.hidden // FP8_BLOCK}, DEFAULT_ROWS_CONFIG, "BLOCK_GROUPS",
                         FP8_BLOCK),
        KernelSpec("mxfp4_to_fp8_cols", _mxfp4_to_fp8_cols_kernel,
                   {"rows_ptr": "*i32", "out_words_ptr": "*i32", "scales_ptr": "*fp32", "counts_ptr": "*i64",
                    "segment_offsets_ptr": "*i64", "num_rows": "i32", "num_experts": "i32", "capacity": "i32",
                    "in_row_stride": "i32"},
                   {"BLOCKS_PER_ROW": variant.hidden // MXFP4_BLOCK, "EXPERTS_POW2": EXPERTS_POW2,
                    "TOKENS": FP8_BLOCK, "BLOCK_COLS": c.block_cols},
                   c.num_warps, FP8_BLOCK * c.block_cols * MXFP4_BLOCK),
    ]
