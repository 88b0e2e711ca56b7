"""Ragged expert segments in a colwise (X^T) operand, shared by the column kernels.

Expert e's tokens are rows [sum(n_<e), sum(n_<=e)) of the input; in X^T they start at column
offset_e, a multiple of 128 (each segment padded to whole 128-token FP8 blocks). The counts stay on
the device: every program derives the layout itself (E is small), so there is no extra launch and
no host sync, and the output is sized for the worst case (`layout.colwise_capacity`).
"""

import torch
import triton
import triton.language as tl

from ..formats import FP8_BLOCK
from ..layout import colwise_capacity


@triton.jit
def block_rows(counts_ptr, segment_offsets_ptr, num_experts, column_start, EXPERTS_POW2: tl.constexpr,
               TOKENS: tl.constexpr):
    """For the 128-token block of X^T starting at column_start: the input row of its first token
    and how many of its tokens are real (0 for padding). Program (0, 0) also writes the segment
    offsets [E + 1].

    One cumsum and one reduction: the block's first row is column_start minus the padding of the
    segments that end at or before it, and its last row + 1 is the token count of the segments
    that start at or before it (empty ones add nothing; past the last segment this gives a count
    <= 0). Both sums travel in one int64 (padding low, tokens high) so the program reduces once.
    int32 arithmetic elsewhere: fewer shuffles than int64. Bad counts give garbage rows, which the
    caller bounds to [0, num_rows)."""
    expert_ids = tl.arange(0, EXPERTS_POW2)
    counts = tl.load(counts_ptr + expert_ids, mask=expert_ids < num_experts, other=0).to(tl.int32)
    padded = (counts + TOKENS - 1) // TOKENS * TOKENS
    segment_ends = tl.cumsum(padded, axis=0)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(segment_offsets_ptr + expert_ids, (segment_ends - padded).to(tl.int64), mask=expert_ids < num_experts)
        tl.store(segment_offsets_ptr + num_experts, tl.sum(padded, axis=0).to(tl.int64))
    padding_before = tl.where(segment_ends <= column_start, padded - counts, 0)
    tokens_started = tl.where(segment_ends - padded <= column_start, counts, 0)
    both = tl.sum(padding_before.to(tl.int64) + (tokens_started.to(tl.int64) << 32), axis=0)
    first_row = column_start - (both & 0xFFFFFFFF).to(tl.int32)
    valid_rows = tl.minimum(tl.maximum((both >> 32).to(tl.int32) - first_row, 0), TOKENS)
    return first_row, valid_rows


@triton.jit
def block_source_rows(counts_ptr, segment_offsets_ptr, num_experts, num_rows, column_start,
                      EXPERTS_POW2: tl.constexpr, TOKENS: tl.constexpr):
    """block_rows, plus per token its input row and whether it is real. Bad counts never lead
    outside [0, num_rows)."""
    first_row, valid_rows = block_rows(counts_ptr, segment_offsets_ptr, num_experts, column_start, EXPERTS_POW2,
                                       TOKENS)
    token = tl.arange(0, TOKENS)
    source_row = (first_row + token).to(tl.int64)
    valid = (token < valid_rows) & (source_row >= 0) & (source_row < num_rows)
    return first_row, valid_rows, source_row, valid


def check_segments(name: str, tokens_per_expert, device, num_rows: int, capacity, check_counts: bool) -> int:
    """Validate the per-expert counts and the capacity of a colwise output; returns the capacity.
    check_counts asserts on the device (no host sync) that the counts are >= 0 and sum to num_rows."""
    if not isinstance(tokens_per_expert, torch.Tensor) or tokens_per_expert.dim() != 1:
        raise TypeError(f"{name}: tokens_per_expert must be a 1-D tensor of per-expert token counts")
    if tokens_per_expert.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: tokens_per_expert must be int32 or int64, got {tokens_per_expert.dtype}")
    if tokens_per_expert.device != device:
        raise ValueError(f"{name}: tokens_per_expert is on {tokens_per_expert.device}, the tokens on {device}")
    num_experts = tokens_per_expert.numel()
    if num_experts == 0:
        raise ValueError(f"{name}: tokens_per_expert is empty (no experts)")
    needed = colwise_capacity(num_rows, num_experts)
    capacity = needed if capacity is None else capacity
    if capacity < needed or capacity % FP8_BLOCK:
        raise ValueError(
            f"{name}: capacity {capacity} must be a multiple of {FP8_BLOCK} and at least {needed} "
            f"for {num_rows} tokens over {num_experts} experts"
        )
    if check_counts:
        counts = tokens_per_expert.long()
        torch._assert_async(
            (counts.sum() == num_rows) & (counts.min() >= 0),
            f"{name}: tokens_per_expert must be non-negative and sum to the number of tokens",
        )
    return capacity


def empty_colwise(hidden: int, capacity: int, num_experts: int, device):
    """The outputs a column kernel fills: segment offsets [E + 1], X^T data [H, capacity] and the
    block scales [capacity / 128, H]."""
    segment_offsets = torch.empty(num_experts + 1, dtype=torch.int64, device=device)
    data = torch.empty(hidden, capacity, dtype=torch.float8_e4m3fn, device=device)
    block_scales = torch.empty(capacity // FP8_BLOCK, hidden, dtype=torch.float32, device=device)
    return segment_offsets, data, block_scales


def experts_pow2(tokens_per_expert: torch.Tensor) -> int:
    return triton.next_power_of_2(tokens_per_expert.numel())
