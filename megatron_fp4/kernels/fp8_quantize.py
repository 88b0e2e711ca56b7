"""BF16 / FP16 / FP32 rows -> FP8 E4M3 with one power-of-two scale per 1x128 block along the row.

Used for gradients on the wire and for activations quantized per GEMM. The scale is the smallest
power of two with amax / scale <= 448 (never below 2^-126); a group holding NaN / Inf gets a NaN
scale and NaN data. Rounding to E4M3 is round to nearest even by one exactly-defined fp32 add
(_bits.e4m3_code_bits), so the CPU interpreter and the GPU agree bit for bit.
"""

from typing import List, Optional

import torch
import triton
import triton.language as tl

from ..formats import FP8_BLOCK
from ..tensors import ROWWISE, FP8BlockTensor
from ._bits import abs_max4, e4m3_word, fp8_block_scale, load_float_quads
from ._checks import TileConfig, check_float_matrix, float_kind, launch_config, quad_ready
from ._format_constants import E4M3_NAN
from ._sm90_spec import BuildVariant, KernelSpec

# block_cols counts 128-element groups. The sweep's candidates (benchmarks/bench_quantizers.py);
# the default (first) was the fastest on H200 at 16384 x 7168 (94.4% of the copy; the others 91.8-93.5%).
CONFIGS = (
    TileConfig(block_rows=8, block_cols=8, num_warps=4),
    TileConfig(block_rows=16, block_cols=8, num_warps=8),
    TileConfig(block_rows=8, block_cols=4, num_warps=4),
    TileConfig(block_rows=32, block_cols=4, num_warps=8),
)
DEFAULT_CONFIG = CONFIGS[0]
# Under the interpreter a program costs about the same whatever its size: 128 rows x 1024 columns a
# program (a quarter of the largest candidate's programs up to 512 columns, an eighth beyond; 4x
# faster at 512 x 512).
INTERPRETER_CONFIG = TileConfig(block_rows=128, block_cols=8, num_warps=8)


@triton.jit
def _quantize_fp8_rows_kernel(
    x_pairs_ptr,
    out_words_ptr,  # int32 view of the FP8 output: four E4M3 bytes per word
    scales_ptr,  # fp32 [groups, num_rows]
    num_rows,
    GROUPS_PER_ROW: tl.constexpr,
    KIND: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
):
    # A [rows, groups, 32] tile of element quads (int64 for 16-bit inputs): each thread reads
    # 16-byte vectors of 8 BF16 and writes its elements' FP8 bytes from the same register layout
    # (16-byte stores, no shared memory); a group's amax is a reduction over the 8 lanes holding it.
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    group = tl.program_id(1) * BLOCK_GROUPS + tl.arange(0, BLOCK_GROUPS)
    quad = tl.arange(0, 32)
    row2 = row[:, None].to(tl.int64)
    group_mask = (row[:, None] < num_rows) & (group[None, :] < GROUPS_PER_ROW)
    quads = row2[:, :, None] * (GROUPS_PER_ROW * 32) + group[None, :, None] * 32 + quad[None, None, :]
    e0, e1, e2, e3 = load_float_quads(x_pairs_ptr, quads, group_mask[:, :, None], KIND)

    scale, inv_scale, is_nan = fp8_block_scale(tl.max(abs_max4(e0, e1, e2, e3), axis=2))
    words = e4m3_word(e0, e1, e2, e3, inv_scale[:, :, None])
    words = tl.where(is_nan[:, :, None], E4M3_NAN * 0x01010101, words)
    tl.store(out_words_ptr + quads, words, mask=group_mask[:, :, None])

    tl.store(scales_ptr + group[None, :].to(tl.int64) * num_rows + row2, scale, mask=group_mask)


def quantize_fp8_rows(x: torch.Tensor, config: Optional[TileConfig] = None) -> FP8BlockTensor:
    """x [R, C] (bf16, fp16 or fp32, C a multiple of 128) -> FP8 1x128 rowwise; config: see
    _checks.launch_config."""
    check_float_matrix("quantize_fp8_rows", x, FP8_BLOCK)
    config = launch_config(config, x.device, DEFAULT_CONFIG, INTERPRETER_CONFIG)
    num_rows, cols = x.shape
    groups = cols // FP8_BLOCK
    data = torch.empty(num_rows, cols, dtype=torch.float8_e4m3fn, device=x.device)
    block_scales = torch.empty(groups, num_rows, dtype=torch.float32, device=x.device)
    if num_rows:
        grid = (triton.cdiv(num_rows, config.block_rows), triton.cdiv(groups, config.block_cols))
        _quantize_fp8_rows_kernel[grid](
            quad_ready(x),
            data.view(torch.int32),
            block_scales,
            num_rows,
            GROUPS_PER_ROW=groups,
            KIND=float_kind(x.dtype),
            BLOCK_ROWS=config.block_rows,
            BLOCK_GROUPS=config.block_cols,
            num_warps=config.num_warps,
        )
    return FP8BlockTensor(data, block_scales, ROWWISE)


def sm90_specs(variant: BuildVariant, config: TileConfig = DEFAULT_CONFIG) -> List[KernelSpec]:
    """The kernel at a tile config (the default one unless given), as sm90_build compiles it."""
    return [KernelSpec.tiled(
        "quantize_fp8_rows", _quantize_fp8_rows_kernel,
        {"x_pairs_ptr": variant.pairs_pointer, "out_words_ptr": "*i32", "scales_ptr": "*fp32", "num_rows": "i32"},
        {"GROUPS_PER_ROW": variant.hidden // FP8_BLOCK, "KIND": variant.input_kind},
        config, "BLOCK_GROUPS", FP8_BLOCK)]
