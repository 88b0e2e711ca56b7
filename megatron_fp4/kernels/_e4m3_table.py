"""The E4M3 bytes of the eight E2M1 magnitudes at every scale gap (DESIGN §4): what the CUDA forward
GEMM that reads MXFP4 (sm90/mxfp4_operand.cuh) converts codes with. Row d: magnitude * 2^(6 - d),
rounded to nearest even into E4M3 (exact while d <= 14); row 255, a gap no two finite scale bytes
make, is 0. tests/ops/test_grouped_gemm_mxfp4.py holds it to megatron_fp4.reference."""

import torch

from ..formats import E2M1_MAGNITUDES, E8M0_MAX_FINITE, FP4_TO_FP8_HEADROOM_LOG2

GAPS = 256


def e4m3_magnitude_table() -> torch.Tensor:
    """uint8 [256, 8] on the CPU."""
    gaps = torch.arange(E8M0_MAX_FINITE + 1, dtype=torch.float64)
    values = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)[None, :] * torch.exp2(FP4_TO_FP8_HEADROOM_LOG2 - gaps)[:, None]
    table = torch.zeros(GAPS, len(E2M1_MAGNITUDES), dtype=torch.uint8)
    # float64 -> fp32 is exact here or both round to 0 (E4M3's smallest step, 2^-9, is far above fp32's).
    table[: gaps.numel()] = values.float().to(torch.float8_e4m3fn).view(torch.uint8)
    return table
