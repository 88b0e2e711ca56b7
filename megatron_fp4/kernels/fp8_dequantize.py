"""FP8 1x128 (rowwise or colwise: the storage is the same) -> BF16: data * block scale in fp32,
rounded to nearest even into bf16."""

from typing import List

import torch
import triton
import triton.language as tl

from ..formats import FP8_BLOCK
from ..tensors import FP8BlockTensor
from ._bits import e4m3_to_fp32, fp32_to_bf16_bits
from ._checks import TileConfig, check_contiguous, check_kernel_device, readable_at
from ._sm90_spec import BuildVariant, KernelSpec

DEFAULT_CONFIG = TileConfig(block_rows=8, block_cols=4, num_warps=4)


@triton.jit
def _dequantize_fp8_kernel(
    data_pairs_ptr,  # int16 view: two E4M3 bytes
    scales_ptr,  # fp32 [groups, num_rows]
    out_pairs_ptr,  # int32 view: two bf16
    num_rows,
    GROUPS_PER_ROW: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
):
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    group = tl.program_id(1) * BLOCK_GROUPS + tl.arange(0, BLOCK_GROUPS)
    pair = tl.arange(0, 64)
    row2 = row[:, None].to(tl.int64)
    group_mask = (row[:, None] < num_rows) & (group[None, :] < GROUPS_PER_ROW)
    offsets = row2[:, :, None] * (GROUPS_PER_ROW * 64) + group[None, :, None] * 64 + pair[None, None, :]
    pairs = tl.load(data_pairs_ptr + offsets, mask=group_mask[:, :, None], other=0).to(tl.int32)
    scale = tl.load(scales_ptr + group[None, :].to(tl.int64) * num_rows + row2, mask=group_mask, other=1.0)
    scale = scale[:, :, None]
    lo = fp32_to_bf16_bits(e4m3_to_fp32(pairs & 0xFF) * scale)
    hi = fp32_to_bf16_bits(e4m3_to_fp32((pairs >> 8) & 0xFF) * scale)
    tl.store(out_pairs_ptr + offsets, lo | (hi << 16), mask=group_mask[:, :, None])


def dequantize_fp8(t: FP8BlockTensor, config: TileConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """FP8 1x128 [R, C] -> BF16 [R, C]."""
    if not isinstance(t, FP8BlockTensor):
        raise TypeError(f"dequantize_fp8: expected an FP8BlockTensor, got {type(t).__name__}")
    check_kernel_device("dequantize_fp8", t.data)
    check_contiguous("dequantize_fp8", "data", t.data)
    check_contiguous("dequantize_fp8", "block_scales", t.block_scales)
    num_rows, cols = t.shape
    groups = cols // FP8_BLOCK
    out = torch.empty(num_rows, cols, dtype=torch.bfloat16, device=t.data.device)
    if num_rows:
        grid = (triton.cdiv(num_rows, config.block_rows), triton.cdiv(groups, config.block_cols))
        _dequantize_fp8_kernel[grid](
            readable_at(t.data, 2).view(torch.int16),
            t.block_scales,
            out.view(torch.int32),
            num_rows,
            GROUPS_PER_ROW=groups,
            BLOCK_ROWS=config.block_rows,
            BLOCK_GROUPS=config.block_cols,
            num_warps=config.num_warps,
        )
    return out


def sm90_specs(variant: BuildVariant) -> List[KernelSpec]:
    """The kernel at DEFAULT_CONFIG, as sm90_build compiles it."""
    return [KernelSpec.tiled(
        "dequantize_fp8", _dequantize_fp8_kernel,
        {"data_pairs_ptr": "*i16", "scales_ptr": "*fp32", "out_pairs_ptr": "*i32", "num_rows": "i32"},
        {"GROUPS_PER_ROW": variant.hidden // FP8_BLOCK}, DEFAULT_CONFIG, "BLOCK_GROUPS", FP8_BLOCK)]
