"""The dispatch all-to-all in MXFP4, as one autograd function.

Forward: quantize the permuted tokens to MXFP4 wire rows (or take the rows the permute already
moved in MXFP4), send them with the same splits as the
BF16 all-to-all would use, and hand back both the received payload (for experts that take FP4)
and its BF16 dequantization (for Megatron's own experts). Backward: straight-through for the
quantization; the gradient goes back BF16 (exact) or FP8 1x128 rows, with the splits swapped.

The splits are host lists, as Megatron's MoEAlltoAllTokenDispatcher computes them before its own
all-to-all: nothing here synchronizes with the device.
"""

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from ..kernels import dequantize_fp8, dequantize_mxfp4, quantize_fp8_rows, quantize_mxfp4
from ..formats import FP8_BLOCK, check_scale_rule
from ..tensors import MXFP4Tensor
from ..options import GradFormat
from .wire import pack_fp8_rows, unpack_fp8_rows


def all_to_all_rows(rows: torch.Tensor, output_splits: List[int], input_splits: List[int], group) -> torch.Tensor:
    """all_to_all_single of whole rows; the output lives on the input's device. A group of one
    rank has nothing to exchange: the rows are returned as they are."""
    if dist.get_world_size(group) == 1:
        return rows
    received = rows.new_empty((sum(output_splits),) + tuple(rows.shape[1:]))
    dist.all_to_all_single(received, rows.contiguous(), output_splits, input_splits, group=group)
    return received


def received_tokens(received: MXFP4Tensor, dtype: torch.dtype, dequantize: bool) -> torch.Tensor:
    """The received tokens as the experts' BF16 input: the payload dequantized (MXFP4 values are
    exact in BF16 and FP32, same exponent range), or, for experts that read the payload itself, an
    uninitialized tensor of that shape: it only carries the gradient path, and skipping the
    dequantization saves a pass over [rows, hidden] per dispatch."""
    if dequantize:
        return dequantize_mxfp4(received).to(dtype)
    return torch.empty(received.shape, dtype=dtype, device=received.rows.device)


class _FP4DispatchAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, output_splits, input_splits, group, scale_rule, grad_format, dequantize, sent_rows):
        ctx.splits = (output_splits, input_splits)
        ctx.group = group
        ctx.grad_format = grad_format
        ctx.input_dtype = tokens.dtype
        hidden = tokens.shape[1]
        sent = quantize_mxfp4(tokens, scale_rule) if sent_rows is None else MXFP4Tensor(sent_rows, hidden, scale_rule)
        received = MXFP4Tensor(all_to_all_rows(sent.rows, output_splits, input_splits, group), hidden, scale_rule)
        ctx.mark_non_differentiable(received.rows)
        return received_tokens(received, tokens.dtype, dequantize), received.rows

    @staticmethod
    def backward(ctx, grad_output, _grad_rows):
        grad = send_gradient_back(grad_output, ctx.splits, ctx.group, ctx.grad_format)
        return grad.to(ctx.input_dtype), None, None, None, None, None, None, None


def send_gradient_back(grad_output: torch.Tensor, splits, group, grad_format: GradFormat) -> torch.Tensor:
    """The received tokens' gradient back to their senders (splits = the forward's (output, input)),
    unquantized ("bf16": in the gradient's own dtype, BF16 in BF16 training) or FP8 1x128 rows on
    the wire; returns rows in the senders' token order."""
    output_splits, input_splits = splits
    if grad_format == GradFormat.BF16:
        return all_to_all_rows(grad_output.contiguous(), input_splits, output_splits, group)
    wire = pack_fp8_rows(quantize_fp8_rows(grad_output.contiguous()))
    received = all_to_all_rows(wire, input_splits, output_splits, group)
    return dequantize_fp8(unpack_fp8_rows(received, grad_output.shape[1]))


def fp4_dispatch_all_to_all(
    tokens: torch.Tensor,
    output_splits: List[int],
    input_splits: List[int],
    group: Optional[dist.ProcessGroup] = None,
    scale_rule: str = "ceil",
    grad_format: GradFormat = GradFormat.BF16,
    dequantize: bool = True,
    quantized: Optional[MXFP4Tensor] = None,
) -> Tuple[torch.Tensor, MXFP4Tensor]:
    """Send tokens [T, H] (rows grouped by destination rank, input_splits rows each) in MXFP4.

    Returns (received tokens in BF16, the received MXFP4 payload). The BF16 tensor carries the
    gradient path; the payload is what FP4-aware experts and the activation cache keep. With
    dequantize=False the BF16 tensor's values are left undefined (see received_tokens): only for
    experts that compute from the payload. With `quantized` (the tokens' MXFP4 rows, quantized
    before the permute) those rows are sent and tokens' values are not read: tokens then only
    carries the gradient path (see permute.permuted_stand_in).
    Wire bytes per token: H/2 + H/32 forward; H * 2 (bf16) or H + H/32 (fp8) backward."""
    check_scale_rule(scale_rule)
    if grad_format not in [g.value for g in GradFormat]:
        raise ValueError(f"grad_format must be one of {[g.value for g in GradFormat]}, got {grad_format!r}")
    grad_format = GradFormat(grad_format)
    if tokens.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"tokens must be bfloat16 or float32 (MXFP4 values can overflow float16), got {tokens.dtype}")
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [num_tokens, hidden], got shape {tuple(tokens.shape)}")
    if sum(input_splits) != tokens.shape[0]:
        raise ValueError(f"input_splits sum to {sum(input_splits)}, tokens has {tokens.shape[0]} rows")
    if grad_format == GradFormat.FP8 and tokens.shape[1] % FP8_BLOCK:
        raise ValueError(f"the fp8 gradient format needs hidden divisible by 128, got {tokens.shape[1]}")
    if quantized is not None and (quantized.shape != tuple(tokens.shape) or quantized.scale_rule != scale_rule):
        raise ValueError(f"quantized rows {quantized.shape} ({quantized.scale_rule}) do not match tokens "
                         f"{tuple(tokens.shape)} ({scale_rule})")
    group = group if group is not None else dist.group.WORLD
    received, rows = _FP4DispatchAllToAll.apply(
        tokens, [int(n) for n in output_splits], [int(n) for n in input_splits], group, scale_rule, grad_format,
        dequantize, None if quantized is None else quantized.rows,
    )
    return received, MXFP4Tensor(rows, tokens.shape[1], scale_rule)


__all__ = ["all_to_all_rows", "fp4_dispatch_all_to_all", "received_tokens", "send_gradient_back"]
