"""Keep the experts' saved input in FP4 (--moe-fp4-saved-input).

Megatron's own experts (SequentialMLP) save their fc1 input for backward: row slices of the
dispatched tokens, which are the exact BF16 dequantization of the received MXFP4 payload. Under
`FP4SavedRows(source, payload)`, autograd's saved-tensor hooks store such a slice as a view of
the payload rows instead (H/2 + H/32 bytes per token instead of 2H) and dequantize it again when
backward asks: lossless, since those values are FP4 values. Nothing saved keeps the BF16 source
alive (an empty slice of it is saved as a fresh empty tensor); every other saved tensor is untouched.
"""

from dataclasses import dataclass
from typing import Optional

import torch

from ..kernels import dequantize_mxfp4
from ..telemetry import Telemetry
from ..tensors import MXFP4Tensor


@dataclass(frozen=True)
class _PayloadRows:
    """A saved slice of the source, kept as the payload rows it was dequantized from."""

    payload: MXFP4Tensor
    shape: tuple
    dtype: torch.dtype
    telemetry: Optional[Telemetry] = None  # told when backward has used the rows


class FP4SavedRows:
    """Context manager; `source` [N, H] must equal the dequantization of `payload` row for row.
    telemetry (--moe-fp4-telemetry): counts the payload rows kept, until backward uses them."""

    def __init__(self, source: torch.Tensor, payload: MXFP4Tensor, telemetry: Optional[Telemetry] = None):
        if source.dim() != 2 or source.shape != payload.shape or not source.is_contiguous():
            raise ValueError(
                f"FP4SavedRows: source {tuple(source.shape)} must be a contiguous [tokens, hidden] tensor matching "
                f"the payload {tuple(payload.shape)}"
            )
        self.source = source
        self.payload = payload
        self.telemetry = telemetry
        self.replaced = 0  # how many saved tensors went to FP4 (for tests and logs)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def _rows_of(self, t: torch.Tensor):
        """(first row, rows) when t is a whole-row slice of the source, else None."""
        source = self.source
        if t.dtype != source.dtype or not t.is_contiguous() or t.numel() == 0:
            return None
        if t.untyped_storage()._cdata != source.untyped_storage()._cdata:
            return None
        hidden = source.shape[1]
        start = t.storage_offset() - source.storage_offset()
        if start < 0 or start % hidden or t.numel() % hidden or t.shape[-1] != hidden:
            return None
        first, count = start // hidden, t.numel() // hidden
        return (first, count) if first + count <= source.shape[0] else None

    def pack(self, t: torch.Tensor):
        if t.numel() == 0 and t.untyped_storage()._cdata == self.source.untyped_storage()._cdata:
            return t.detach().clone()  # an expert without tokens: its empty view would keep the source alive
        rows = self._rows_of(t)
        if rows is None:
            return t
        first, count = rows
        self.replaced += 1
        payload = self.payload
        rows = payload.rows[first : first + count]
        if self.telemetry is not None:
            self.telemetry.hold(rows.numel())
        return _PayloadRows(MXFP4Tensor(rows, payload.hidden, payload.scale_rule), tuple(t.shape), t.dtype,
                            self.telemetry)

    @staticmethod
    def unpack(saved):
        if isinstance(saved, _PayloadRows):
            if saved.telemetry is not None:
                saved.telemetry.release(saved.payload.rows.numel())
            return dequantize_mxfp4(saved.payload).to(saved.dtype).view(saved.shape)
        return saved

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        # Autograd keeps the pack hook (bound to self) with every tensor it packed until backward:
        # drop the BF16 source here, or it would stay alive beside the FP4 rows kept in its place.
        self.source = self.payload = self.telemetry = None
        return self._hooks.__exit__(*exc)


__all__ = ["FP4SavedRows"]
