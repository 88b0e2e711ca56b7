"""MXFP4 wire rows -> BF16 [T, H], one pass: each packed byte becomes one int32 holding two bf16."""

from typing import List, Optional

import torch
import triton
import triton.language as tl

from ..formats import MXFP4_BLOCK
from ..tensors import MXFP4Tensor
from ._checks import TileConfig, check_kernel_device, launch_config
from ._format_constants import E8M0_NAN
from ._sm90_spec import BuildVariant, KernelSpec

DEFAULT_CONFIG = TileConfig(block_rows=8, block_cols=16, num_warps=4)
# Under the interpreter a program costs about the same whatever its size (launch_config): 128 rows
# x 512 hidden, 9-14x less time than the GPU's tiles at the tests' shapes.
INTERPRETER_CONFIG = TileConfig(block_rows=128, block_cols=16, num_warps=4)


@triton.jit
def _e2m1_times_scale_bf16(code, scale):
    """bf16 bits of E2M1 code * scale (fp32, a power of two or NaN). The product has at most two
    significant bits, so its top 16 bits are the exact bf16 (subnormal, Inf and NaN included)."""
    magnitude = code & 7
    # fp32 bits of the magnitude: c * 2^22 + 0x3F000000 for c >= 2 (1.0 .. 6.0), 0.5 for c = 1.
    mag_bits = tl.where(magnitude < 2, magnitude * 0x3F000000, (magnitude << 22) + 0x3F000000)
    value_bits = (mag_bits.to(tl.float32, bitcast=True) * scale).to(tl.int32, bitcast=True)
    return (value_bits >> 16) | ((code & 8) << 12)  # the product is positive: no sign to mask


@triton.jit
def e8m0_scale(scale_byte):
    """The fp32 value of an E8M0 scale byte (int32): 2^(byte - 127); byte 0 is the subnormal
    2^-127, byte 255 a NaN that every product inherits."""
    scale_bits = tl.where(scale_byte == 0, 0x00400000, scale_byte << 23)
    return tl.where(scale_byte == E8M0_NAN, 0x7FC00000, scale_bits).to(tl.float32, bitcast=True)


@triton.jit
def _dequantize_mxfp4_kernel(
    rows_ptr,
    out_pairs_ptr,
    num_rows,
    in_row_stride,
    BLOCKS_PER_ROW: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    block = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    byte_in_block = tl.arange(0, 16)
    row2 = row[:, None].to(tl.int64)
    block_mask = (row[:, None] < num_rows) & (block[None, :] < BLOCKS_PER_ROW)
    in_row = rows_ptr + row2 * in_row_stride
    column = block[None, :, None] * 16 + byte_in_block[None, None, :]
    packed = tl.load(in_row[:, :, None] + column, mask=block_mask[:, :, None], other=0).to(tl.int32)
    scale_byte = tl.load(in_row + BLOCKS_PER_ROW * 16 + block[None, :], mask=block_mask, other=0).to(tl.int32)
    scale = e8m0_scale(scale_byte)[:, :, None]
    lo = _e2m1_times_scale_bf16(packed & 0xF, scale)
    hi = _e2m1_times_scale_bf16(packed >> 4, scale)
    out_offsets = row2[:, :, None] * (BLOCKS_PER_ROW * 16) + column
    tl.store(out_pairs_ptr + out_offsets, lo | (hi << 16), mask=block_mask[:, :, None])


def dequantize_mxfp4(q: MXFP4Tensor, config: Optional[TileConfig] = None) -> torch.Tensor:
    """MXFP4 -> BF16 [T, H]. NaN blocks give NaN."""
    if not isinstance(q, MXFP4Tensor):
        raise TypeError(f"dequantize_mxfp4: expected an MXFP4Tensor, got {type(q).__name__}")
    check_kernel_device("dequantize_mxfp4", q.rows)
    config = launch_config(config, q.rows.device, DEFAULT_CONFIG, INTERPRETER_CONFIG)
    out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    if q.num_tokens == 0:
        return out
    blocks_per_row = q.hidden // MXFP4_BLOCK
    grid = (triton.cdiv(q.num_tokens, config.block_rows), triton.cdiv(blocks_per_row, config.block_cols))
    _dequantize_mxfp4_kernel[grid](
        q.rows,
        out.view(torch.int32),
        q.num_tokens,
        q.rows.stride(0),
        BLOCKS_PER_ROW=blocks_per_row,
        BLOCK_ROWS=config.block_rows,
        BLOCK_COLS=config.block_cols,
        num_warps=config.num_warps,
    )
    return out


def sm90_specs(variant: BuildVariant) -> List[KernelSpec]:
    """The kernel at DEFAULT_CONFIG, as sm90_build compiles it."""
    return [KernelSpec.tiled(
        "dequantize_mxfp4", _dequantize_mxfp4_kernel,
        {"rows_ptr": "*u8", "out_pairs_ptr": "*i32", "num_rows": "i32", "in_row_stride": "i32"},
        {"BLOCKS_PER_ROW": variant.hidden // MXFP4_BLOCK}, DEFAULT_CONFIG, "BLOCK_COLS", MXFP4_BLOCK)]
