"""--moe-fp4-telemetry: what the FP4 dispatch did in each training step, for Megatron's log.

The MoE layers record into one `Telemetry` per process (`recorder()`); the training loop ends each
step (`end_step`) and reads the numbers at its logged iterations (`read`), which
megatron_fp4.launch.telemetry_log adds to Megatron's iteration log line, TensorBoard and W&B.
Recorded per step and GPU:

- dispatch bytes: the rows each dispatch hands to its all-to-all (this GPU's own share included,
  as the estimator counts them) times their wire size: MXFP4 forward, the gradient's format
  backward; next to what BF16 (2 bytes per element) would have sent. A recompute served by the
  cache sends nothing forward, where BF16 would have sent again.
- the relative RMS error of the MXFP4 quantization of the dispatched tokens, sqrt(sum (q - x)^2 /
  sum x^2) over up to SAMPLED_ROWS rows of each dispatch taken at an even stride (rows quantize
  independently, so the sample is quantized again exactly as the dispatch quantized it); where the
  permute moved MXFP4 rows, the rows are the layer's tokens, each once (dropped ones included);
- cache hits: recomputes whose dispatch the recompute cache replayed;
- FP4 storage held: bytes of cached payloads and of activations kept in MXFP4 for backward, from
  when they are kept until they are used; the step's peak.

Recording reads nothing back from the GPU: byte counts come from shapes (host integers), the error
sums stay on the device. `read` makes the one host read, and reduces over the ranks.
"""

import math
from dataclasses import dataclass, fields
from typing import Optional

import torch
import torch.distributed as dist

from .formats import fp8_wire_bytes_per_row, mxfp4_wire_bytes_per_row
from .kernels import dequantize_mxfp4, quantize_mxfp4
from .options import GradFormat

SAMPLED_ROWS = 64
BF16_BYTES = 2
MB, MIB = 1e6, 2**20


@dataclass
class _Counts:
    """Host integers summed since the last read."""

    forward: int = 0
    forward_bf16: int = 0
    backward: int = 0
    backward_bf16: int = 0
    cache_hits: int = 0


@dataclass(frozen=True)
class StepNumbers:
    """Per training step and GPU: the mean over the steps since the last read and over the ranks;
    the held peak is the largest on any rank in any of those steps, the error is pooled over all
    sampled rows (None without any)."""

    steps: int
    dispatch_forward_bytes: float
    dispatch_forward_bf16_bytes: float
    dispatch_backward_bytes: float
    dispatch_backward_bf16_bytes: float
    cache_hits: float
    fp4_held_peak_bytes: float
    relative_rms_error: Optional[float]

    def scalars(self) -> dict:
        """Names and values for TensorBoard / W&B."""
        names = {"dispatch_forward_bytes": "fp4/dispatch-forward-bytes",
                 "dispatch_forward_bf16_bytes": "fp4/dispatch-forward-bytes-bf16",
                 "dispatch_backward_bytes": "fp4/dispatch-backward-bytes",
                 "dispatch_backward_bf16_bytes": "fp4/dispatch-backward-bytes-bf16",
                 "cache_hits": "fp4/cache-hits", "fp4_held_peak_bytes": "fp4/held-peak-bytes",
                 "relative_rms_error": "fp4/dispatch-relative-rms-error"}
        return {name: getattr(self, field) for field, name in names.items() if getattr(self, field) is not None}

    def log_text(self) -> str:
        """Fields for Megatron's iteration log line (' name: value |' each)."""
        error = "-" if self.relative_rms_error is None else f"{self.relative_rms_error:.3E}"
        return (f" fp4 dispatch fwd MB: {self.dispatch_forward_bytes / MB:.3f} "
                f"(bf16 {self.dispatch_forward_bf16_bytes / MB:.3f}) |"
                f" fp4 dispatch bwd MB: {self.dispatch_backward_bytes / MB:.3f} "
                f"(bf16 {self.dispatch_backward_bf16_bytes / MB:.3f}) |"
                f" fp4 rel rms error: {error} |"
                f" fp4 cache hits: {self.cache_hits:.1f} |"
                f" fp4 held peak MiB: {self.fp4_held_peak_bytes / MIB:.3f} |")


class _CountGradient(torch.autograd.Function):
    """Identity; its backward counts the gradient rows the dispatch sends back."""

    @staticmethod
    def forward(ctx, tokens, telemetry, grad_format):
        ctx.telemetry, ctx.grad_format = telemetry, grad_format
        return tokens.view_as(tokens)

    @staticmethod
    def backward(ctx, grad):
        ctx.telemetry.gradient_sent(grad, ctx.grad_format)
        return grad, None, None


class Telemetry:
    def __init__(self):
        self._counts = _Counts()
        self._steps = 0
        self._held = 0
        self._held_peak = 0
        self._error_sums = None  # on the device: [sum of squared errors, sum of squares] of the sampled rows

    # What the layers record (nothing read from the device).

    def dispatched(self, tokens: torch.Tensor, received: torch.Tensor, replayed: bool, scale_rule: str,
                   grad_format: GradFormat, values: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One dispatch of `tokens` [rows, hidden] (the rows handed to the all-to-all); `received`
        is what it delivered to the experts, returned with its gradient counted when it has one.
        replayed: the recompute cache served it (nothing sent forward). values: where tokens holds
        no values (the permute was done on MXFP4 rows), the tokens it permuted, each once: the
        quantization error is sampled from them."""
        rows, hidden = tokens.shape
        self._counts.forward_bf16 += rows * hidden * BF16_BYTES
        if replayed:
            self._counts.cache_hits += 1
        else:
            self._counts.forward += rows * mxfp4_wire_bytes_per_row(hidden)
            self._sample_error(tokens if values is None else values, scale_rule)
        if received.requires_grad:
            return _CountGradient.apply(received, self, grad_format)
        return received

    def gradient_sent(self, grad: torch.Tensor, grad_format: GradFormat) -> None:
        rows, hidden = grad.shape
        per_row = fp8_wire_bytes_per_row(hidden) if grad_format == GradFormat.FP8 else hidden * grad.element_size()
        self._counts.backward += rows * per_row
        self._counts.backward_bf16 += rows * hidden * BF16_BYTES

    def hold(self, nbytes: int) -> None:
        """FP4 storage kept for later (a cached payload, activations saved in MXFP4)."""
        self._held += nbytes
        self._held_peak = max(self._held_peak, self._held)

    def release(self, nbytes: int) -> None:
        """FP4 storage that hold() counted, now used."""
        self._held -= nbytes

    @property
    def held_bytes(self) -> int:
        """FP4 storage held now."""
        return self._held

    def _sample_error(self, tokens: torch.Tensor, scale_rule: str) -> None:
        rows = tokens.shape[0]
        if rows == 0:
            return
        with torch.no_grad():
            sample = tokens.detach()[:: max(1, rows // SAMPLED_ROWS)][:SAMPLED_ROWS].contiguous()
            x = sample.float()
            error = dequantize_mxfp4(quantize_mxfp4(sample, scale_rule)).float() - x
            sums = torch.stack([error.square().sum(), x.square().sum()])
            self._error_sums = sums if self._error_sums is None else self._error_sums + sums

    # The training loop's side.

    def end_step(self) -> None:
        self._steps += 1

    def read(self, group: Optional[dist.ProcessGroup] = None) -> Optional[StepNumbers]:
        """The numbers since the last read, over the ranks of `group` (default: all; every rank of
        it must call read at the same point), then start counting afresh. One host read. None
        before any end_step."""
        steps = self._steps
        if steps == 0:
            return None
        device = _collective_device(group)
        counts = [getattr(self._counts, f.name) for f in fields(_Counts)]
        sums = torch.tensor(counts + [0.0, 0.0], dtype=torch.float64, device=device)
        if self._error_sums is not None:
            sums[-2:] += self._error_sums.to(device, torch.float64)
        peak = torch.tensor([self._held_peak], dtype=torch.float64, device=device)
        ranks = 1
        if dist.is_initialized():
            ranks = dist.get_world_size(group)
            dist.all_reduce(sums, group=group)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        *totals, squared_error, squares, held_peak = torch.cat([sums, peak]).tolist()  # the host read
        self._counts, self._steps, self._error_sums = _Counts(), 0, None
        self._held_peak = self._held
        mean = _Counts(*(total / (steps * ranks) for total in totals))
        return StepNumbers(
            steps, dispatch_forward_bytes=mean.forward, dispatch_forward_bf16_bytes=mean.forward_bf16,
            dispatch_backward_bytes=mean.backward, dispatch_backward_bf16_bytes=mean.backward_bf16,
            cache_hits=mean.cache_hits, fp4_held_peak_bytes=held_peak,
            relative_rms_error=math.sqrt(squared_error / squares) if squares > 0 else None)


def _collective_device(group) -> torch.device:
    """Where a collective over `group` takes its tensors: the GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_RECORDER: Optional[Telemetry] = None


def recorder() -> Telemetry:
    """This process's Telemetry (created on first use)."""
    global _RECORDER
    if _RECORDER is None:
        _RECORDER = Telemetry()
    return _RECORDER


__all__ = ["SAMPLED_ROWS", "StepNumbers", "Telemetry", "recorder"]
