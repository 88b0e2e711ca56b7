"""W^T from W in FP8 128x128 blocks, without re-quantizing: each block of W^T is a block of W
transposed with the same scale (a block's amax, and so its scale and every rounded value, do not
depend on the block's orientation), so the data gradient's operand comes from the experts' cached
forward weights (fp8/weight_cache.py) by moving bytes: one FP8 read and write per element
instead of a BF16 read, a quantization and an FP8 write.

One program per 128x128 block: it loads the block's rows and stores them as the columns of the
transposed block; the block scales are transposed by torch (a few KB).
"""

from typing import List

import torch
import triton
import triton.language as tl

from ..formats import FP8_BLOCK
from ..tensors import FP8StackedWeights, padded_scale_columns
from ._checks import check_kernel_device
from ._sm90_spec import BuildVariant, KernelSpec


@triton.jit
def _transpose_fp8_blocks_kernel(src_ptr, dst_ptr, ROWS: tl.constexpr, COLS: tl.constexpr, BLOCK: tl.constexpr):
    row_block, col_block, expert = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    rows = row_block * BLOCK + tl.arange(0, BLOCK)
    cols = col_block * BLOCK + tl.arange(0, BLOCK)
    base = expert * ROWS * COLS
    block = tl.load(src_ptr + base + rows[:, None] * COLS + cols[None, :])
    tl.store(dst_ptr + base + cols[:, None] * ROWS + rows[None, :], tl.trans(block))


def transpose_fp8_weights(weights: FP8StackedWeights) -> FP8StackedWeights:
    """[E, cols, rows]: every expert's W^T, the same bits as quantize_fp8_weights_stacked(W, True)."""
    name = "transpose_fp8_weights"
    if not isinstance(weights, FP8StackedWeights):
        raise TypeError(f"{name}: expected FP8StackedWeights, got {type(weights).__name__}")
    check_kernel_device(name, weights.data)
    experts, rows, cols = weights.data.shape
    data = torch.empty(experts, cols, rows, dtype=torch.float8_e4m3fn, device=weights.data.device)
    block_scales = torch.ones(experts, cols // FP8_BLOCK, padded_scale_columns(rows), dtype=torch.float32,
                              device=weights.data.device)
    block_scales[:, :, : rows // FP8_BLOCK] = weights.block_scales[:, :, : cols // FP8_BLOCK].transpose(1, 2)
    if experts:
        _transpose_fp8_blocks_kernel[(rows // FP8_BLOCK, cols // FP8_BLOCK, experts)](
            weights.data.view(torch.uint8), data.view(torch.uint8), ROWS=rows, COLS=cols, BLOCK=FP8_BLOCK, num_warps=4,
        )
    return FP8StackedWeights(data, block_scales)


def sm90_specs(variant: BuildVariant) -> List[KernelSpec]:
    """The kernel for fc1's weights [2 x 2048, hidden], as sm90_build compiles it."""
    return [KernelSpec("transpose_fp8_weights", _transpose_fp8_blocks_kernel, {"src_ptr": "*u8", "dst_ptr": "*u8"},
                       {"ROWS": 2 * 2048, "COLS": variant.hidden, "BLOCK": FP8_BLOCK}, 4, FP8_BLOCK * FP8_BLOCK)]


__all__ = ["transpose_fp8_weights"]
