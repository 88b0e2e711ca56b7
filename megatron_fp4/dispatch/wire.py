"""Packing of quantized rows into one uint8 row per token, so that one all-to-all with the
token splits carries data and scales together.

MXFP4 rows are already in wire form (MXFP4Tensor.rows: H/2 data bytes, then H/32 scale bytes).
FP8 1x128 rows (the optional gradient format) travel as H E4M3 bytes followed by the H/128 fp32
scales' bytes.
"""

import torch

from ..formats import fp8_wire_bytes_per_row
from ..tensors import ROWWISE, FP8BlockTensor


def pack_fp8_rows(t: FP8BlockTensor) -> torch.Tensor:
    """Rowwise FP8 [T, H] -> uint8 [T, H + 4 H/128] (one copy)."""
    if t.layout != ROWWISE:
        raise ValueError("pack_fp8_rows: only the rowwise layout travels per token")
    # A fresh row-major copy: .contiguous() would keep the transposed stride of a size-1 dimension
    # (H = 128: one scale per row), which the byte view refuses.
    scales = t.block_scales.t()
    scales_per_row = torch.empty(scales.shape, dtype=scales.dtype, device=scales.device).copy_(scales)
    scales_per_row = scales_per_row.view(torch.uint8)  # [T, 4 * H/128]
    return torch.cat([t.data.view(torch.uint8), scales_per_row], dim=1)


def unpack_fp8_rows(rows: torch.Tensor, hidden: int) -> FP8BlockTensor:
    """Inverse of pack_fp8_rows."""
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != fp8_wire_bytes_per_row(hidden):
        raise ValueError(
            f"unpack_fp8_rows: expected uint8 [T, {fp8_wire_bytes_per_row(hidden)}] for hidden {hidden}, "
            f"got {rows.dtype} {tuple(rows.shape)}"
        )
    data = rows[:, :hidden].contiguous().view(torch.float8_e4m3fn)
    scales = rows[:, hidden:].contiguous().view(torch.float32)  # [T, H/128]
    return FP8BlockTensor(data, scales.t().contiguous(), ROWWISE)
