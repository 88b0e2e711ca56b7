"""MXFP4 -> FP8 1x128, in the integer domain (DESIGN §4): no BF16 or FP32 copy in memory.

Rows (the fprop operand): per token and 128-column group with scale bytes e0..e3, S = max(e_i),
each element becomes E2M1 * 2^(e_i - S + 6) in E4M3 and the group's scale is 2^(S - 133).

Columns (the wgrad operand): per expert segment and per 128-token block of it, the same with S
taken over the block's tokens for each MXFP4 block column. The kernel reads FP4 rows and writes
X^T directly; each expert's segment starts at a multiple of 128 columns, zero-filled past its last
token. Per-expert token counts stay on the device: the output is sized for the worst case.

Blocks holding NaN / Inf (byte 255) take no part in S and become E4M3 NaN.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from ..formats import FP8_BLOCK, MXFP4_BLOCK
from ..reference import colwise_capacity, padded_segment_offsets
from ..tensors import COLWISE, ROWWISE, FP8BlockTensor, MXFP4Tensor
from ._bits import e2m1_to_e4m3, pow2_fp32
from ._checks import TileConfig, check_hidden_multiple, check_kernel_device

# block_cols counts 128-element groups for rows and 32-element MXFP4 blocks for columns.
DEFAULT_ROWS_CONFIG = TileConfig(block_rows=8, block_cols=4, num_warps=4)
DEFAULT_COLS_CONFIG = TileConfig(block_rows=FP8_BLOCK, block_cols=8, num_warps=4)

_SCALE_BIAS = 133  # FP8 scale = 2^(S - 127 - 6)
_E4M3_NAN = 0x7F


@triton.jit
def _fp4_byte_to_fp8_pair(packed, scale_byte, group_max):
    """Two E4M3 bytes (low element in bits 0-7) from one packed E2M1 byte."""
    gap = group_max - scale_byte
    lo = e2m1_to_e4m3(packed & 0xF, gap)
    hi = e2m1_to_e4m3(packed >> 4, gap)
    is_nan = scale_byte == 255
    lo = tl.where(is_nan, 0x7F, lo)
    hi = tl.where(is_nan, 0x7F, hi)
    return lo, hi


@triton.jit
def _mxfp4_to_fp8_rows_kernel(
    rows_ptr,
    out_pairs_ptr,
    scales_ptr,  # fp32 [groups, num_rows]
    num_rows,
    in_row_stride,
    GROUPS_PER_ROW: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
):
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    group = tl.program_id(1) * BLOCK_GROUPS + tl.arange(0, BLOCK_GROUPS)
    sub_block = tl.arange(0, 4)
    byte_in_block = tl.arange(0, 16)
    row2 = row[:, None].to(tl.int64)
    group_mask = (row[:, None] < num_rows) & (group[None, :] < GROUPS_PER_ROW)
    in_row = rows_ptr + row2 * in_row_stride

    block = group[None, :, None] * 4 + sub_block[None, None, :]  # [1, G, 4]
    scale_byte = tl.load(in_row[:, :, None] + GROUPS_PER_ROW * 64 + block, mask=group_mask[:, :, None], other=0)
    scale_byte = scale_byte.to(tl.int32)
    group_max = tl.max(tl.where(scale_byte == 255, 0, scale_byte), axis=2)  # [R, G]

    column = block[:, :, :, None] * 16 + byte_in_block[None, None, None, :]  # [1, G, 4, 16]
    mask4 = group_mask[:, :, None, None]
    packed = tl.load(in_row[:, :, None, None] + column, mask=mask4, other=0).to(tl.int32)
    lo, hi = _fp4_byte_to_fp8_pair(packed, scale_byte[:, :, :, None], group_max[:, :, None, None])
    out_offsets = row2[:, :, None, None] * (GROUPS_PER_ROW * 64) + column
    tl.store(out_pairs_ptr + out_offsets, (lo | (hi << 8)).to(tl.int16), mask=mask4)

    scale = pow2_fp32(group_max - 133)
    tl.store(scales_ptr + group[None, :].to(tl.int64) * num_rows + row2, scale, mask=group_mask)


def _check_mxfp4(name: str, q: MXFP4Tensor) -> None:
    if not isinstance(q, MXFP4Tensor):
        raise TypeError(f"{name}: expected an MXFP4Tensor, got {type(q).__name__}")
    check_hidden_multiple(name, q.hidden, FP8_BLOCK)
    check_kernel_device(name, q.rows)


def mxfp4_to_fp8_rows(q: MXFP4Tensor, config: TileConfig = DEFAULT_ROWS_CONFIG) -> FP8BlockTensor:
    """MXFP4 [T, H] -> FP8 [T, H] with 1x128 scales along H (hidden a multiple of 128)."""
    _check_mxfp4("mxfp4_to_fp8_rows", q)
    num_rows, hidden = q.shape
    groups = hidden // FP8_BLOCK
    data = torch.empty(num_rows, hidden, dtype=torch.float8_e4m3fn, device=q.device)
    block_scales = torch.empty(groups, num_rows, dtype=torch.float32, device=q.device)
    if num_rows:
        grid = (triton.cdiv(num_rows, config.block_rows), triton.cdiv(groups, config.block_cols))
        _mxfp4_to_fp8_rows_kernel[grid](
            q.rows,
            data.view(torch.int16),
            block_scales,
            num_rows,
            q.rows.stride(0),
            GROUPS_PER_ROW=groups,
            BLOCK_ROWS=config.block_rows,
            BLOCK_GROUPS=config.block_cols,
            num_warps=config.num_warps,
        )
    return FP8BlockTensor(data, block_scales, ROWWISE)


@triton.jit
def _mxfp4_to_fp8_cols_kernel(
    rows_ptr,
    out_ptr,  # uint8 [hidden, capacity]
    scales_ptr,  # fp32 [capacity / 128, hidden]
    segment_offsets_ptr,  # int64 [E + 1], 128-aligned column of each expert's segment
    source_offsets_ptr,  # int64 [E + 1], first row of each expert in rows_ptr
    num_rows,
    num_experts,
    capacity,
    in_row_stride,
    BLOCKS_PER_ROW: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    TOKENS: tl.constexpr,  # 128: one FP8 block along tokens
    BLOCK_COLS: tl.constexpr,  # MXFP4 blocks of hidden per program
):
    column_start = tl.program_id(0) * TOKENS
    # The expert owning this 128-token block: segments ending at or before it come earlier.
    expert_ids = tl.arange(0, EXPERTS_POW2)
    segment_ends = tl.load(segment_offsets_ptr + 1 + expert_ids, mask=expert_ids < num_experts, other=capacity + 1)
    expert = tl.sum((segment_ends <= column_start).to(tl.int32), axis=0)
    has_expert = expert < num_experts
    safe_expert = tl.minimum(expert, num_experts - 1)
    segment_start = tl.load(segment_offsets_ptr + safe_expert)
    first_row = tl.load(source_offsets_ptr + safe_expert)
    expert_rows = tl.load(source_offsets_ptr + safe_expert + 1) - first_row
    local = column_start - segment_start
    valid_rows = tl.where(has_expert, tl.minimum(tl.maximum(expert_rows - local, 0), TOKENS), 0)

    token = tl.arange(0, TOKENS)
    source_row = (first_row + local + token).to(tl.int64)
    token_mask = (token < valid_rows) & (source_row < num_rows)
    block = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    block_mask = block < BLOCKS_PER_ROW
    mask2 = token_mask[:, None] & block_mask[None, :]
    in_row = rows_ptr + source_row * in_row_stride

    scale_byte = tl.load(in_row[:, None] + BLOCKS_PER_ROW * 16 + block[None, :], mask=mask2, other=0).to(tl.int32)
    group_max = tl.max(tl.where(scale_byte == 255, 0, scale_byte), axis=0)  # [BLOCK_COLS]
    byte_in_block = tl.arange(0, 16)
    packed = tl.load(
        in_row[:, None, None] + block[None, :, None] * 16 + byte_in_block[None, None, :],
        mask=mask2[:, :, None],
        other=0,
    ).to(tl.int32)
    lo, hi = _fp4_byte_to_fp8_pair(packed, scale_byte[:, :, None], group_max[None, :, None])
    # [tokens, blocks, 16, 2] -> [tokens, hidden] -> X^T tile [hidden, tokens]
    fp8 = tl.reshape(tl.join(lo, hi).to(tl.uint8), (TOKENS, BLOCK_COLS * 32))
    fp8_t = tl.trans(fp8)
    hidden_index = tl.program_id(1) * BLOCK_COLS * 32 + tl.arange(0, BLOCK_COLS * 32)
    hidden_mask = hidden_index < BLOCKS_PER_ROW * 32
    out_offsets = hidden_index[:, None].to(tl.int64) * capacity + column_start + token[None, :]
    tl.store(out_ptr + out_offsets, fp8_t, mask=hidden_mask[:, None])

    scale = pow2_fp32(group_max - 133)  # [BLOCK_COLS]
    scale_per_column = tl.reshape(tl.broadcast_to(scale[:, None], (BLOCK_COLS, 32)), (BLOCK_COLS * 32,))
    scale_offsets = tl.program_id(0).to(tl.int64) * (BLOCKS_PER_ROW * 32) + hidden_index
    tl.store(scales_ptr + scale_offsets, scale_per_column, mask=hidden_mask)


def mxfp4_to_fp8_cols(
    q: MXFP4Tensor,
    tokens_per_expert: torch.Tensor,
    capacity: Optional[int] = None,
    config: TileConfig = DEFAULT_COLS_CONFIG,
) -> FP8BlockTensor:
    """MXFP4 rows of E ragged expert segments -> X^T [H, capacity] in FP8, 1x128 along tokens.

    tokens_per_expert: int32/int64 [E] on q's device (read on the device, no host sync); rows
    of q are the experts' tokens back to back. capacity defaults to colwise_capacity(T, E), the
    most the 128-aligned segments can take. Counts that do not sum to T trip a device assert."""
    _check_mxfp4("mxfp4_to_fp8_cols", q)
    if not isinstance(tokens_per_expert, torch.Tensor) or tokens_per_expert.dim() != 1:
        raise TypeError("mxfp4_to_fp8_cols: tokens_per_expert must be a 1-D tensor of per-expert token counts")
    if tokens_per_expert.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"mxfp4_to_fp8_cols: tokens_per_expert must be int32 or int64, got {tokens_per_expert.dtype}")
    if tokens_per_expert.device != q.device:
        raise ValueError(
            f"mxfp4_to_fp8_cols: tokens_per_expert is on {tokens_per_expert.device}, the payload on {q.device}"
        )
    num_experts = tokens_per_expert.numel()
    if num_experts == 0:
        raise ValueError("mxfp4_to_fp8_cols: tokens_per_expert is empty (no experts)")
    num_rows, hidden = q.shape
    needed = colwise_capacity(num_rows, num_experts)
    capacity = needed if capacity is None else capacity
    if capacity < needed or capacity % FP8_BLOCK:
        raise ValueError(
            f"mxfp4_to_fp8_cols: capacity {capacity} must be a multiple of {FP8_BLOCK} and at least {needed} "
            f"for {num_rows} tokens over {num_experts} experts"
        )
    counts = tokens_per_expert.long()
    torch._assert_async(
        (counts.sum() == num_rows) & (counts.min() >= 0),
        "mxfp4_to_fp8_cols: tokens_per_expert must be non-negative and sum to the number of tokens",
    )
    segment_offsets = padded_segment_offsets(counts)
    source_offsets = torch.nn.functional.pad(torch.cumsum(counts, 0), (1, 0))
    data = torch.empty(hidden, capacity, dtype=torch.float8_e4m3fn, device=q.device)
    block_scales = torch.empty(capacity // FP8_BLOCK, hidden, dtype=torch.float32, device=q.device)
    blocks_per_row = hidden // MXFP4_BLOCK
    grid = (capacity // FP8_BLOCK, triton.cdiv(blocks_per_row, config.block_cols))
    _mxfp4_to_fp8_cols_kernel[grid](
        q.rows,
        data.view(torch.uint8),
        block_scales,
        segment_offsets,
        source_offsets,
        num_rows,
        num_experts,
        capacity,
        q.rows.stride(0),
        BLOCKS_PER_ROW=blocks_per_row,
        EXPERTS_POW2=triton.next_power_of_2(num_experts),
        TOKENS=FP8_BLOCK,
        BLOCK_COLS=config.block_cols,
        num_warps=config.num_warps,
    )
    return FP8BlockTensor(data, block_scales, COLWISE, segment_offsets)
