"""BF16 / FP16 / FP32 rows -> MXFP4 wire rows (docs/design.md §2.3), one pass.

Each program takes a [BLOCK_ROWS, BLOCK_COLS, 16] tile of element pairs: BLOCK_COLS MXFP4 blocks
of 32 elements per row, loaded as 16 integers so that unpacking needs no shuffles and the packed
byte of a pair is one OR. The scale comes from integer operations on the block's largest |x|
bits, the rounding from one exactly-defined fp32 add, so the CPU interpreter and the GPU agree
bit for bit. The kernel is issue-bound before it is memory-bound: every instruction per element
counts (benchmarks/kernel_sass_stats.py).
"""

from typing import List, Optional

import torch
import triton
import triton.language as tl

from ..formats import MXFP4_BLOCK, check_scale_rule
from ..tensors import MXFP4Tensor
from ._bits import unpack_float_pair
from ._checks import TileConfig, check_float_matrix, float_kind, launch_config, pairs_ready
from ._format_constants import E8M0_MAX_FINITE, E8M0_NAN
from ._sm90_spec import BuildVariant, KernelSpec

DEFAULT_CONFIG = TileConfig(block_rows=8, block_cols=32, num_warps=4)
# Under the interpreter a program costs about the same whatever its size (launch_config): 128 rows
# x 512 hidden, 6-10x less time than the GPU's tiles at the tests' shapes.
INTERPRETER_CONFIG = TileConfig(block_rows=128, block_cols=16, num_warps=4)


@triton.jit
def _e2m1_code(bits, inv_scale, SATURATE: tl.constexpr):
    """4-bit E2M1 code of the fp32 with int32 bits, divided by its power-of-two scale.

    Adding 2^(22 + k), k = clamp(exponent, 0, 2), makes the fp32 add itself round to the E2M1
    step of v's binade (0.5 below 2, 1 below 4, 2 above), ties to even; the integer difference
    is then the step count, and 2k shifts it onto the code. Under the "ceil" rule v <= 6, so the
    result never passes code 7; "floor" may round up to 8 and saturates."""
    v = (bits & 0x7FFFFFFF).to(tl.float32, bitcast=True) * inv_scale
    v_bits = v.to(tl.int32, bitcast=True)
    k = tl.minimum(tl.maximum((v_bits >> 23) - 127, 0), 2)
    magic = (k << 23) + 0x4A800000  # fp32 bits of 2^(22 + k)
    rounded = (v + magic.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True)
    magnitude = rounded - magic + 2 * k
    if SATURATE:
        magnitude = tl.minimum(magnitude, 7)
    return magnitude | ((bits >> 28) & 8)


@triton.jit
def mxfp4_block_scale(amax, CEIL_RULE: tl.constexpr):
    """A block's E8M0 scale from the int32 bits of its largest |x| (NaN / Inf bits sort above every
    finite value): (scale byte, 1 / scale in fp32, whether the block is NaN)."""
    biased_exp = amax >> 23
    if CEIL_RULE:
        # amax = 1.m * 2^E: the smallest k with amax <= 6 * 2^k is E - 2, plus 1 when 1.m > 1.5.
        scale_byte = biased_exp - 2 + ((amax & 0x7FFFFF) > 0x400000).to(tl.int32)
    else:
        scale_byte = biased_exp - 2
    scale_byte = tl.minimum(tl.maximum(scale_byte, 0), E8M0_MAX_FINITE)
    is_nan = biased_exp == 255  # fp32's all-ones exponent: NaN or Inf
    scale_byte = tl.where(is_nan, E8M0_NAN, scale_byte)
    # 2^(127 - byte): a normal fp32 for every finite byte (0..253).
    inv_scale = ((254 - tl.minimum(scale_byte, 253)) << 23).to(tl.float32, bitcast=True)
    return scale_byte, inv_scale, is_nan


@triton.jit
def _quantize_mxfp4_kernel(
    x_pairs_ptr,
    rows_ptr,
    num_rows,
    x_row_stride,  # in pairs
    out_row_stride,  # in bytes
    BLOCKS_PER_ROW: tl.constexpr,
    KIND: tl.constexpr,
    CEIL_RULE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    block = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    pair = tl.arange(0, 16)
    row2 = row[:, None].to(tl.int64)
    block_mask = (row[:, None] < num_rows) & (block[None, :] < BLOCKS_PER_ROW)
    offsets = row2[:, :, None] * x_row_stride + block[None, :, None] * 16 + pair[None, None, :]
    words = tl.load(x_pairs_ptr + offsets, mask=block_mask[:, :, None], other=0)
    lo, hi = unpack_float_pair(words, KIND)

    # |x| as int32 orders like the float, and NaN / Inf bit patterns sort above every finite value.
    amax = tl.max(tl.maximum(lo & 0x7FFFFFFF, hi & 0x7FFFFFFF), axis=2)
    scale_byte, inv_scale, is_nan = mxfp4_block_scale(amax, CEIL_RULE)
    inv_scale = inv_scale[:, :, None]

    packed = _e2m1_code(lo, inv_scale, not CEIL_RULE) | (_e2m1_code(hi, inv_scale, not CEIL_RULE) << 4)
    packed = tl.where(is_nan[:, :, None], 0, packed)  # a NaN block stores all-zero codes
    out_row = rows_ptr + row2 * out_row_stride
    tl.store(out_row[:, :, None] + block[None, :, None] * 16 + pair[None, None, :], packed.to(tl.uint8),
             mask=block_mask[:, :, None])
    tl.store(out_row + BLOCKS_PER_ROW * 16 + block[None, :], scale_byte.to(tl.uint8), mask=block_mask)


def quantize_mxfp4(
    x: torch.Tensor,
    scale_rule: str = "ceil",
    out: Optional[MXFP4Tensor] = None,
    config: Optional[TileConfig] = None,
) -> MXFP4Tensor:
    """Quantize x [T, H] (bf16, fp16 or fp32, H a multiple of 32) to MXFP4 wire rows.

    out: an MXFP4Tensor to write into (e.g. a slice of an all-to-all send buffer)."""
    check_scale_rule(scale_rule)
    check_float_matrix("quantize_mxfp4", x, MXFP4_BLOCK)
    config = launch_config(config, x.device, DEFAULT_CONFIG, INTERPRETER_CONFIG)
    num_rows, hidden = x.shape
    if out is None:
        out = MXFP4Tensor.empty(num_rows, hidden, x.device, scale_rule)
    elif out.shape != x.shape or out.device != x.device or out.scale_rule != scale_rule:
        raise ValueError(
            f"quantize_mxfp4: out is {tuple(out.shape)} on {out.device} ({out.scale_rule}), "
            f"input is {tuple(x.shape)} on {x.device} ({scale_rule})"
        )
    if num_rows == 0:
        return out
    blocks_per_row = hidden // MXFP4_BLOCK
    grid = (triton.cdiv(num_rows, config.block_rows), triton.cdiv(blocks_per_row, config.block_cols))
    _quantize_mxfp4_kernel[grid](
        pairs_ready(x),
        out.rows,
        num_rows,
        hidden // 2,
        out.rows.stride(0),
        BLOCKS_PER_ROW=blocks_per_row,
        KIND=float_kind(x.dtype),
        CEIL_RULE=scale_rule == "ceil",
        BLOCK_ROWS=config.block_rows,
        BLOCK_COLS=config.block_cols,
        num_warps=config.num_warps,
    )
    return out


def sm90_specs(variant: BuildVariant) -> List[KernelSpec]:
    """The kernel at DEFAULT_CONFIG, as sm90_build compiles it."""
    return [KernelSpec.tiled(
        "quantize_mxfp4", _quantize_mxfp4_kernel,
        {"x_pairs_ptr": variant.pairs_pointer, "rows_ptr": "*u8", "num_rows": "i32", "x_row_stride": "i32",
         "out_row_stride": "i32"},
        {"BLOCKS_PER_ROW": variant.hidden // MXFP4_BLOCK, "KIND": variant.input_kind, "CEIL_RULE": variant.ceil_rule},
        DEFAULT_CONFIG, "BLOCK_COLS", MXFP4_BLOCK)]
