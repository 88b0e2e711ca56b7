"""Pure-PyTorch reference of every operation: the definition of the truth (docs/design.md §2-§3).

Written for clarity, not speed: float64 where that makes a step exact, torch's own float8 cast for
the final E4M3 rounding, Python loops over experts. Runs on CPU and GPU. The Triton kernels are
tested against these functions bit for bit.
"""

from typing import Optional, Sequence, Union

import torch

from .formats import (
    E2M1_MAGNITUDES,
    E2M1_SIGN_BIT,
    E4M3_MAX,
    E8M0_BIAS,
    E8M0_MAX_FINITE,
    E8M0_NAN,
    FP4_TO_FP8_HEADROOM_LOG2,
    FP8_BLOCK,
    MXFP4_BLOCK,
    check_scale_rule,
)
from .layout import colwise_capacity, padded_segment_offsets
from .tensors import COLWISE, ROWWISE, FP8BlockTensor, FP8BlockWeight, MXFP4Tensor, padded_scale_columns

# log2 of the fp32 FP8 scale offset: scale = 2^(S - 127 - 6) for a group whose largest byte is S.
_FP8_SCALE_BIAS = E8M0_BIAS + FP4_TO_FP8_HEADROOM_LOG2
# FP8 1x128 scales of BF16 data never go below the smallest normal fp32 power of two.
_FP8_MIN_SCALE_LOG2 = -126


def _e2m1_grid(device) -> torch.Tensor:
    return torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64, device=device)


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2**exponent in float64, exact for every exponent used here."""
    return torch.ldexp(torch.ones_like(exponent, dtype=torch.float64), exponent.to(torch.int32))


def _round_to_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Magnitude codes 0..7 of non-negative float64 v: nearest E2M1 value, ties to even code,
    values above 6 saturate to 6."""
    grid = _e2m1_grid(v.device)
    lo = (torch.bucketize(v, grid, right=True) - 1).clamp(0, 7)
    hi = (lo + 1).clamp(max=7)
    below = v - grid[lo]
    above = grid[hi] - v
    take_hi = (above < below) | ((above == below) & (hi % 2 == 0))
    return torch.where(take_hi, hi, lo)


def mxfp4_scale_bytes(amax: torch.Tensor, scale_rule: str) -> torch.Tensor:
    """E8M0 byte for each block amax (finite, >= 0), as int64; NaN handling is the caller's.

    ceil:  byte = 127 + ceil(log2(amax / 6)), so amax / scale <= 6 and nothing clips.
    floor: byte = 127 + floor(log2(amax)) - 2 (OCP), elements saturate at 6.
    """
    mant, exp = torch.frexp(amax.double())  # amax = mant * 2^exp with mant in [0.5, 1)
    if scale_rule == "ceil":
        # 6 * 2^k = 0.75 * 2^(k + 3): the smallest k with amax <= 6 * 2^k.
        log2_scale = exp - 3 + (mant > 0.75).to(exp.dtype)
    else:
        log2_scale = (exp - 1) - 2
    byte = (log2_scale + E8M0_BIAS).clamp(0, E8M0_MAX_FINITE)
    return torch.where(amax == 0, torch.zeros_like(byte), byte).long()


def quantize_mxfp4(x: torch.Tensor, scale_rule: str = "ceil") -> MXFP4Tensor:
    """BF16 / FP16 / FP32 [T, H] -> MXFP4 rows."""
    check_scale_rule(scale_rule)
    num_tokens, hidden = x.shape
    blocks = x.float().reshape(num_tokens, hidden // MXFP4_BLOCK, MXFP4_BLOCK)
    finite = torch.isfinite(blocks)
    block_is_nan = ~finite.all(dim=-1)
    amax = torch.where(finite, blocks.abs(), 0.0).amax(dim=-1)
    scale_byte = mxfp4_scale_bytes(amax, scale_rule)
    scaled = torch.ldexp(blocks.double().abs(), (E8M0_BIAS - scale_byte).unsqueeze(-1).to(torch.int32))
    codes = _round_to_e2m1(torch.where(finite, scaled, 0.0))
    codes = codes | (torch.signbit(blocks).long() * E2M1_SIGN_BIT)
    codes = torch.where(block_is_nan.unsqueeze(-1), 0, codes)  # a NaN block stores all-zero codes
    scale_byte = torch.where(block_is_nan, E8M0_NAN, scale_byte)

    codes = codes.reshape(num_tokens, hidden).to(torch.uint8)
    data = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return MXFP4Tensor.from_parts(data, scale_byte.to(torch.uint8), scale_rule)


def unpack_e2m1_codes(data: torch.Tensor) -> torch.Tensor:
    """uint8 [T, H/2] -> int64 [T, H] 4-bit codes, element 2j from the low nibble."""
    low = (data & 0xF).long()
    high = (data >> 4).long()
    return torch.stack([low, high], dim=-1).reshape(data.shape[0], data.shape[1] * 2)


def _e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """Signed float64 value of each 4-bit code (code 8 is -0.0)."""
    magnitude = _e2m1_grid(codes.device)[codes & 7]
    return torch.where((codes & E2M1_SIGN_BIT) != 0, -magnitude, magnitude)


def _per_element(block_values: torch.Tensor, block: int) -> torch.Tensor:
    return block_values.repeat_interleave(block, dim=-1)


def dequantize_mxfp4(q: MXFP4Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """MXFP4 rows -> [T, H] in dtype; NaN blocks give NaN."""
    codes = unpack_e2m1_codes(q.data)
    scale_byte = _per_element(q.scales.long(), MXFP4_BLOCK)
    values = _e2m1_values(codes) * _pow2(scale_byte - E8M0_BIAS)
    values = torch.where(scale_byte == E8M0_NAN, float("nan"), values)
    return values.float().to(dtype)


def _fp8_from_fp4_groups(codes: torch.Tensor, scale_byte: torch.Tensor, group_max: torch.Tensor) -> torch.Tensor:
    """E4M3 of code * 2^(6 - d) with d = group_max - scale_byte, NaN blocks -> NaN.

    codes, scale_byte, group_max: broadcast-compatible per-element int64 tensors."""
    gap = group_max - scale_byte
    values = _e2m1_values(codes) * _pow2(FP4_TO_FP8_HEADROOM_LOG2 - gap)
    values = torch.where(scale_byte == E8M0_NAN, float("nan"), values)
    return values.float().to(torch.float8_e4m3fn)


def _finite_bytes(scale_byte: torch.Tensor) -> torch.Tensor:
    """NaN blocks take no part in a group's largest scale (their elements become FP8 NaN)."""
    return torch.where(scale_byte == E8M0_NAN, 0, scale_byte)


def _fp8_group_scale(group_max: torch.Tensor) -> torch.Tensor:
    return _pow2(group_max - _FP8_SCALE_BIAS).float()


def mxfp4_to_fp8_rows(q: MXFP4Tensor) -> FP8BlockTensor:
    """MXFP4 rows -> FP8 1x128 rows (the fprop operand), exact where the scale gap d <= 14."""
    num_tokens, hidden = q.shape
    groups = hidden // FP8_BLOCK
    blocks_per_group = FP8_BLOCK // MXFP4_BLOCK
    scale_byte = q.scales.long()
    group_max = _finite_bytes(scale_byte).reshape(num_tokens, groups, blocks_per_group).amax(dim=-1)
    data = _fp8_from_fp4_groups(
        unpack_e2m1_codes(q.data),
        _per_element(scale_byte, MXFP4_BLOCK),
        _per_element(group_max, FP8_BLOCK),
    )
    block_scales = _fp8_group_scale(group_max).t().contiguous()
    return FP8BlockTensor(data, block_scales, ROWWISE)


def _ragged_layout(num_tokens: int, tokens_per_expert, capacity: Optional[int]):
    """(counts on the host, capacity of the colwise output, 128-aligned segment offsets) for rows
    that are the experts' tokens back to back; the counts must sum to num_tokens."""
    counts = torch.as_tensor(tokens_per_expert, dtype=torch.int64).cpu()
    if counts.sum().item() != num_tokens:
        raise ValueError(f"tokens_per_expert sums to {counts.sum().item()}, the tensor has {num_tokens} tokens")
    capacity = colwise_capacity(num_tokens, len(counts)) if capacity is None else capacity
    return counts, capacity, torch.tensor(padded_segment_offsets(counts), dtype=torch.int64)


def fp8_columns_of_segment(codes: torch.Tensor, scale_byte: torch.Tensor):
    """One expert's tokens (codes [n, H], scale bytes [n, H/32], n > 0) -> X^T [H, ceil128(n)] in
    FP8 and its scales [ceil128(n) / 128, H]; tokens past n are zeros with byte 0."""
    count = codes.shape[0]
    blocks = -(-count // FP8_BLOCK)
    pad = blocks * FP8_BLOCK - count
    codes = torch.nn.functional.pad(codes, (0, 0, 0, pad))
    scale_byte = torch.nn.functional.pad(scale_byte, (0, 0, 0, pad))
    # [blocks, 128 tokens, H/32]: the largest finite byte over the block's tokens.
    group_max = _finite_bytes(scale_byte).reshape(blocks, FP8_BLOCK, -1).amax(dim=1)
    values = _fp8_from_fp4_groups(
        codes,
        _per_element(scale_byte, MXFP4_BLOCK),
        _per_element(group_max.repeat_interleave(FP8_BLOCK, dim=0), MXFP4_BLOCK),
    )
    return values.t(), _per_element(_fp8_group_scale(group_max), MXFP4_BLOCK)


def mxfp4_to_fp8_cols(
    q: MXFP4Tensor, tokens_per_expert: Union[torch.Tensor, Sequence[int]], capacity: Optional[int] = None
) -> FP8BlockTensor:
    """MXFP4 rows of ragged expert segments -> X^T in FP8 with 1x128 blocks along tokens.

    Expert e's tokens are rows [sum(n_<e), sum(n_<=e)) of q; in the output they start at column
    padded_segment_offsets[e], a multiple of 128, and each 128-token block takes the largest scale
    byte of its column's MXFP4 block over its tokens. Missing tokens are zeros with byte 0.
    """
    num_tokens, hidden = q.shape
    counts, capacity, offsets = _ragged_layout(num_tokens, tokens_per_expert, capacity)
    codes = unpack_e2m1_codes(q.data)
    scale_byte = q.scales.long()

    data_t = torch.zeros(hidden, capacity, dtype=torch.float8_e4m3fn, device=q.device)
    # Blocks holding no token (padding past the last segment) have group max 0: scale 2^-133.
    block_scales = torch.full((capacity // FP8_BLOCK, hidden), 2.0**-_FP8_SCALE_BIAS, device=q.device)
    first_row = 0
    for expert, count in enumerate(counts.tolist()):
        rows = slice(first_row, first_row + count)
        first_row += count
        if count == 0:
            continue
        values_t, scales = fp8_columns_of_segment(codes[rows], scale_byte[rows])
        start = int(offsets[expert])
        data_t[:, start : start + values_t.shape[1]] = values_t
        block_scales[start // FP8_BLOCK : start // FP8_BLOCK + scales.shape[0]] = scales
    return FP8BlockTensor(data_t, block_scales, COLWISE, offsets.to(q.device))


def fp8_scale_log2(amax: torch.Tensor) -> torch.Tensor:
    """log2 of the power-of-two scale of a 1x128 group: the smallest k with amax <= 448 * 2^k,
    never below 2^-126 (zero and tiny groups keep a normal fp32 scale)."""
    mant, exp = torch.frexp(amax.double())
    # 448 * 2^k = 0.875 * 2^(k + 9)
    log2_scale = exp - 9 + (mant > E4M3_MAX / 512).to(exp.dtype)
    log2_scale = torch.where(amax == 0, _FP8_MIN_SCALE_LOG2, log2_scale)
    return log2_scale.clamp(min=_FP8_MIN_SCALE_LOG2).long()


def quantize_fp8_rows(x: torch.Tensor) -> FP8BlockTensor:
    """BF16 / FP16 / FP32 [R, C] -> FP8 with 1x128 blocks along C (gradients on the wire).
    A group holding NaN or Inf gets a NaN scale and NaN data."""
    rows, cols = x.shape
    groups = x.float().reshape(rows, cols // FP8_BLOCK, FP8_BLOCK)
    finite = torch.isfinite(groups)
    group_is_nan = ~finite.all(dim=-1)
    amax = torch.where(finite, groups.abs(), 0.0).amax(dim=-1)
    log2_scale = fp8_scale_log2(amax)
    scaled = (groups.double() * _pow2(-log2_scale).unsqueeze(-1)).float()
    scaled = torch.where(group_is_nan.unsqueeze(-1), float("nan"), scaled)
    scale = torch.where(group_is_nan, float("nan"), _pow2(log2_scale).float())
    data = scaled.to(torch.float8_e4m3fn).reshape(rows, cols)
    return FP8BlockTensor(data, scale.t().contiguous(), ROWWISE)


def quantize_fp8_cols(
    x: torch.Tensor, tokens_per_expert: Union[torch.Tensor, Sequence[int]], capacity: Optional[int] = None
) -> FP8BlockTensor:
    """BF16 / FP16 / FP32 rows of ragged expert segments -> X^T in FP8 with 1x128 blocks along tokens
    (the gradient operand of the expert wgrad GEMM): each expert's tokens are placed at its
    128-aligned segment offset in a zero-filled [capacity, H], which is then quantized as rows of
    its transpose. Padding blocks are zeros with scale 2^-126."""
    num_tokens, hidden = x.shape
    counts, capacity, offsets = _ragged_layout(num_tokens, tokens_per_expert, capacity)
    placed = x.new_zeros(capacity, hidden)
    first_row = 0
    for expert, count in enumerate(counts.tolist()):
        placed[int(offsets[expert]) : int(offsets[expert]) + count] = x[first_row : first_row + count]
        first_row += count
    t = quantize_fp8_rows(placed.t().contiguous())
    return FP8BlockTensor(t.data, t.block_scales, COLWISE, offsets.to(x.device))


def quantize_fp8_weight(w: torch.Tensor, transpose: bool = False) -> FP8BlockWeight:
    """BF16 / FP16 / FP32 [R, C] (both multiples of 128) -> FP8 with one power-of-two scale per
    128x128 block, the scale rule of quantize_fp8_rows over the whole block; of w^T when
    transpose (the same blocks, transposed: the dgrad operand). A block holding NaN or Inf gets a
    NaN scale and NaN data."""
    if transpose:
        w = w.t()
    rows, cols = w.shape
    blocks = w.float().reshape(rows // FP8_BLOCK, FP8_BLOCK, cols // FP8_BLOCK, FP8_BLOCK)
    finite = torch.isfinite(blocks)
    block_is_nan = ~finite.all(dim=3).all(dim=1)
    amax = torch.where(finite, blocks.abs(), 0.0).amax(dim=3).amax(dim=1)
    log2_scale = fp8_scale_log2(amax)
    scaled = (blocks.double() * _pow2(-log2_scale)[:, None, :, None]).float()
    scaled = torch.where(block_is_nan[:, None, :, None], float("nan"), scaled)
    scale = torch.where(block_is_nan, float("nan"), _pow2(log2_scale).float())
    block_scales = torch.ones(rows // FP8_BLOCK, padded_scale_columns(cols), dtype=torch.float32, device=w.device)
    block_scales[:, : cols // FP8_BLOCK] = scale
    return FP8BlockWeight(scaled.to(torch.float8_e4m3fn).reshape(rows, cols), block_scales)


def dequantize_fp8_weight(t: FP8BlockWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """FP8 128x128 blocks -> [rows, cols] in dtype: data * its block's scale in fp32."""
    scale = t.scales().repeat_interleave(FP8_BLOCK, dim=0).repeat_interleave(FP8_BLOCK, dim=1)
    return (t.data.float() * scale).to(dtype)


def dequantize_fp8(t: FP8BlockTensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """FP8 1x128 (either layout) -> [rows, cols] in dtype: data * its block's scale in fp32."""
    scale = _per_element(t.scaled_mm_scales(), FP8_BLOCK)
    return (t.data.float() * scale).to(dtype)


def sum_rows_by_token(rows: torch.Tensor, indices: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[num_tokens, H]: out[t] = the rows p with indices[p] == t added in fp32 in ascending p, then
    rounded once to rows' dtype (0 for a token without rows): the MoE unpermute and the permute's
    gradient (kernels/row_sums.py)."""
    acc = torch.zeros(num_tokens, rows.shape[1], dtype=torch.float32, device=rows.device)
    for position, token in enumerate(indices.tolist()):
        acc[token] += rows[position].float()
    return acc.to(rows.dtype)
