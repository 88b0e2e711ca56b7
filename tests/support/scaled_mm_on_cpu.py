"""TEST SUPPORT ONLY: an fp32 emulation of torch.nn.functional.scaled_mm with block scales, so
that the FP8 experts run on a CPU (CI) exactly as on the GPU up to the multiply-accumulate.

The production GEMM (megatron_fp4.fp8.gemm) refuses CPU operands; tests install this
function as its `scaled_mm_off_cuda`: tests/conftest.py for the pytest process, tests/support/cuda_on_cpu.py
for the processes it spawns. The product is that of the dequantized operands in fp32.
"""

from typing import Optional

import torch
import torch.nn.functional as F

from megatron_fp4.fp8 import gemm
from megatron_fp4.formats import FP8_BLOCK


def _dequantize_b(b: torch.Tensor, scale_b: torch.Tensor, recipe_b, k_blocks: int) -> torch.Tensor:
    if recipe_b == F.ScalingType.BlockWise128x128:
        # scale_b is (round_up(K/128, 4), N/128): the padding rows are unused.
        scales = scale_b[:k_blocks].repeat_interleave(FP8_BLOCK, dim=0).repeat_interleave(FP8_BLOCK, dim=1)
        return b.float() * scales
    return b.float() * scale_b.t().repeat_interleave(FP8_BLOCK, dim=0)


def scaled_mm_on_cpu(a, b, scale_a, recipe_a, scale_b, recipe_b, out_dtype,
                     out: Optional[torch.Tensor]) -> torch.Tensor:
    """gemm.scaled_mm_off_cuda: a's 1x128 blocks and b's (1x128 or 128x128) blocks dequantized,
    multiplied in fp32, rounded to out_dtype (written into `out` when given)."""
    assert recipe_a == F.ScalingType.BlockWise1x128, recipe_a
    b_values = _dequantize_b(b, scale_b, recipe_b, a.shape[1] // FP8_BLOCK)
    product = ((a.float() * scale_a.repeat_interleave(FP8_BLOCK, dim=1)) @ b_values).to(out_dtype)
    return product if out is None else out.copy_(product)


def install() -> None:
    gemm.scaled_mm_off_cuda = scaled_mm_on_cpu


def uninstall() -> None:
    gemm.scaled_mm_off_cuda = None
