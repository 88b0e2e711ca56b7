"""Containers for the two quantized layouts. Plain data holders: no autograd, no kernels.

MXFP4Tensor keeps one token per row in the wire format of docs/design.md §2.3 (H/2 bytes of packed E2M1
data, then H/32 E8M0 scale bytes), so the same buffer can go through the all-to-all unchanged.

FP8BlockTensor keeps E4M3 data [rows, cols] with one power-of-two fp32 scale per 1x128 block
along cols; FP8BlockWeight keeps the expert weights with one scale per 128x128 block. The scales are stored transposed, [cols/128, rows] contiguous, because that is the
layout torch.nn.functional.scaled_mm takes for BlockWise1x128 operands on SM90.
"""

from dataclasses import dataclass
from typing import Optional

import torch

from .formats import FP8_BLOCK, MXFP4_BLOCK, check_scale_rule, mxfp4_wire_bytes_per_row


@dataclass(frozen=True)
class MXFP4Tensor:
    """A [tokens, hidden] tensor in MXFP4, blocks of 32 along hidden.

    rows: uint8 [tokens, hidden/2 + hidden/32]; element 2j in the low nibble of byte j,
          element 2j+1 in the high nibble; then one E8M0 byte per block of 32.
    """

    rows: torch.Tensor
    hidden: int
    scale_rule: str = "ceil"

    def __post_init__(self):
        check_scale_rule(self.scale_rule)
        if self.hidden <= 0 or self.hidden % MXFP4_BLOCK:
            raise ValueError(f"hidden must be a positive multiple of {MXFP4_BLOCK}, got {self.hidden}")
        if self.rows.dtype != torch.uint8 or self.rows.dim() != 2:
            raise ValueError(f"rows must be a 2-D uint8 tensor, got {self.rows.dtype} {tuple(self.rows.shape)}")
        if self.rows.shape[1] != mxfp4_wire_bytes_per_row(self.hidden):
            raise ValueError(
                f"rows has {self.rows.shape[1]} bytes per token; hidden {self.hidden} needs "
                f"{mxfp4_wire_bytes_per_row(self.hidden)} (hidden/2 data + hidden/32 scales)"
            )
        if self.rows.stride(1) != 1:
            raise ValueError("rows must be contiguous along its last dimension")

    @classmethod
    def empty(cls, num_tokens: int, hidden: int, device, scale_rule: str = "ceil") -> "MXFP4Tensor":
        rows = torch.empty(num_tokens, mxfp4_wire_bytes_per_row(hidden), dtype=torch.uint8, device=device)
        return cls(rows, hidden, scale_rule)

    @classmethod
    def from_parts(cls, data: torch.Tensor, scales: torch.Tensor, scale_rule: str = "ceil") -> "MXFP4Tensor":
        """Pack separate data [T, H/2] and scales [T, H/32] into the wire layout (one copy)."""
        if data.dim() != 2 or scales.dim() != 2 or data.shape[0] != scales.shape[0]:
            raise ValueError(f"data {tuple(data.shape)} and scales {tuple(scales.shape)} do not match")
        hidden = data.shape[1] * 2
        return cls(torch.cat([data, scales], dim=1).contiguous(), hidden, scale_rule)

    @property
    def num_tokens(self) -> int:
        return self.rows.shape[0]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.num_tokens, self.hidden))

    @property
    def device(self) -> torch.device:
        return self.rows.device

    def select_tokens(self, indices: torch.Tensor) -> "MXFP4Tensor":
        """The rows of the tokens `indices`, in that order (a permute done on the wire rows)."""
        rows = self.rows.contiguous()
        # Whole rows move as 8- or 4-byte words where the row width allows (a byte-wise gather is slower).
        word = next(dtype for dtype in (torch.int64, torch.int32, torch.uint8)
                    if rows.shape[1] % dtype.itemsize == 0 and rows.storage_offset() % dtype.itemsize == 0)
        selected = rows.view(word).index_select(0, indices).view(torch.uint8)
        return MXFP4Tensor(selected, self.hidden, self.scale_rule)

    @property
    def data(self) -> torch.Tensor:
        """uint8 [T, H/2] packed E2M1 codes (a strided view into rows)."""
        return self.rows[:, : self.hidden // 2]

    @property
    def scales(self) -> torch.Tensor:
        """uint8 [T, H/32] E8M0 scale bytes (a strided view into rows)."""
        return self.rows[:, self.hidden // 2 :]


ROWWISE = "rowwise"  # [tokens, hidden], blocks along hidden: the fprop / dgrad operand
COLWISE = "colwise"  # [hidden, padded tokens], blocks along tokens: the wgrad operand


@dataclass(frozen=True)
class FP8BlockTensor:
    """E4M3 data [rows, cols] with one power-of-two fp32 scale per 1x128 block along cols.

    block_scales: fp32 [cols/128, rows] contiguous; scaled_mm_scales() is its transpose, shape
                  (rows, cols/128) with strides (1, rows), as scaled_mm BlockWise1x128 expects.
    layout: ROWWISE for a [tokens, hidden] operand, COLWISE for the transposed [hidden, tokens]
            operand built per expert segment.
    segment_offsets: COLWISE only: int64 [experts + 1] on the data's device; expert e owns
                  columns [offsets[e], offsets[e+1]), each a multiple of 128 (zero-filled past
                  the expert's last token). Columns past offsets[-1] are zero padding.
    """

    data: torch.Tensor
    block_scales: torch.Tensor
    layout: str = ROWWISE
    segment_offsets: Optional[torch.Tensor] = None

    def __post_init__(self):
        if self.layout not in (ROWWISE, COLWISE):
            raise ValueError(f"layout must be {ROWWISE!r} or {COLWISE!r}, got {self.layout!r}")
        if self.data.dtype != torch.float8_e4m3fn or self.data.dim() != 2:
            raise ValueError(f"data must be 2-D float8_e4m3fn, got {self.data.dtype} {tuple(self.data.shape)}")
        rows, cols = self.data.shape
        if cols % FP8_BLOCK:
            raise ValueError(f"cols must be a multiple of {FP8_BLOCK}, got {cols}")
        if self.block_scales.dtype != torch.float32 or tuple(self.block_scales.shape) != (cols // FP8_BLOCK, rows):
            raise ValueError(
                f"block_scales must be fp32 [{cols // FP8_BLOCK}, {rows}], got "
                f"{self.block_scales.dtype} {tuple(self.block_scales.shape)}"
            )
        if (self.segment_offsets is not None) != (self.layout == COLWISE):
            raise ValueError("segment_offsets is required for the colwise layout and only there")

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def colwise_parts(self) -> tuple:
        """A colwise operand as the tensors autograd's save_for_backward takes; from_colwise_parts
        rebuilds it."""
        if self.layout != COLWISE:
            raise ValueError("colwise_parts is for the colwise layout")
        return self.data, self.block_scales, self.segment_offsets

    @classmethod
    def from_colwise_parts(cls, parts) -> "FP8BlockTensor":
        data, block_scales, segment_offsets = parts
        return cls(data, block_scales, COLWISE, segment_offsets)

    def scaled_mm_scales(self) -> torch.Tensor:
        """The scales as torch.nn.functional.scaled_mm takes them: (rows, cols/128), strides (1, rows)."""
        return self.block_scales.t()


def padded_scale_columns(cols: int) -> int:
    """Scale columns of a 128x128-block operand: cols/128 rounded up to a multiple of 4, the
    padding cuBLAS asks of a BlockWise128x128 scale tensor."""
    return -(-(cols // FP8_BLOCK) // 4) * 4


@dataclass(frozen=True)
class FP8BlockWeight:
    """E4M3 data [rows, cols] with one power-of-two fp32 scale per 128x128 block: a weight as the
    second operand of Y = X W^T (rows = output features, cols = input features).

    block_scales: fp32 [rows/128, padded_scale_columns(cols)] contiguous, the columns past
                  cols/128 set to 1.0 and never read. scaled_mm_operand() gives (data.t(),
                  block_scales.t()), the (b, scale_b) scaled_mm takes for BlockWise128x128 on SM90.
    """

    data: torch.Tensor
    block_scales: torch.Tensor

    def __post_init__(self):
        if self.data.dtype != torch.float8_e4m3fn or self.data.dim() != 2:
            raise ValueError(f"data must be 2-D float8_e4m3fn, got {self.data.dtype} {tuple(self.data.shape)}")
        rows, cols = self.data.shape
        if rows % FP8_BLOCK or cols % FP8_BLOCK:
            raise ValueError(f"a block-scaled weight needs both sides multiples of {FP8_BLOCK}, got {rows} x {cols}")
        expected = (rows // FP8_BLOCK, padded_scale_columns(cols))
        if self.block_scales.dtype != torch.float32 or tuple(self.block_scales.shape) != expected:
            raise ValueError(
                f"block_scales must be fp32 {list(expected)}, got {self.block_scales.dtype} "
                f"{tuple(self.block_scales.shape)}"
            )

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def scales(self) -> torch.Tensor:
        """fp32 [rows/128, cols/128]: one scale per block, without the padding."""
        return self.block_scales[:, : self.data.shape[1] // FP8_BLOCK]

    def scaled_mm_operand(self):
        return self.data.t(), self.block_scales.t()


@dataclass(frozen=True)
class FP8StackedWeights:
    """The weights of all local experts of one linear layer as one operand of the grouped GEMMs:
    data [E, rows, cols] and block_scales [E, rows/128, padded_scale_columns(cols)], expert e's
    part being the FP8BlockWeight `self[e]`."""

    data: torch.Tensor
    block_scales: torch.Tensor

    def __post_init__(self):
        if self.data.dim() != 3 or self.block_scales.dim() != 3 or self.data.shape[0] != self.block_scales.shape[0]:
            raise ValueError(f"expected data [E, rows, cols] and block_scales [E, rows/128, *], got "
                             f"{tuple(self.data.shape)} and {tuple(self.block_scales.shape)}")
        if not (self.data.is_contiguous() and self.block_scales.is_contiguous()):
            raise ValueError("stacked weights must be contiguous")
        self[0]  # validates one expert's shapes and dtypes

    @property
    def num_experts(self) -> int:
        return self.data.shape[0]

    def __getitem__(self, expert: int) -> FP8BlockWeight:
        return FP8BlockWeight(self.data[expert], self.block_scales[expert])
