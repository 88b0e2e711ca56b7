"""The order in which the grouped GEMMs' Triton programs take output tiles, and the expert of a row
tile (the expert ids come from the caller)."""

import triton
import triton.language as tl


@triton.jit
def swizzled(pid, num_tiles_m, num_tiles_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program pid, GROUP_M row tiles side by side so that the weight
    tiles they share are read while still in L2."""
    per_group = GROUP_M * num_tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_size, (pid % per_group) // group_size


@triton.jit
def tile_of_expert(offsets_ptr, num_experts, tile, expert_ids, BLOCK_M: tl.constexpr):
    """Row tile `tile` of the flat tile space: (expert, first row, end row of the expert), or an
    expert == num_experts for a tile past the last one. expert_ids: 0 .. a power of two >= the
    number of experts (the caller's arange)."""
    in_range = expert_ids < num_experts
    starts = tl.load(offsets_ptr + expert_ids, mask=in_range, other=0)
    ends = tl.load(offsets_ptr + expert_ids + 1, mask=in_range, other=0)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    tile_ends = tl.cumsum(tiles, axis=0)
    expert = tl.sum(((tile_ends <= tile) & in_range).to(tl.int32), axis=0)
    mine = expert_ids == expert
    first_row = tl.sum(tl.where(mine, starts + (tile - (tile_ends - tiles)) * BLOCK_M, 0), axis=0)
    end_row = tl.sum(tl.where(mine, ends, 0), axis=0)
    return expert, first_row, end_row
