"""The recompute pass of a cached dispatch: forward hands back what the first pass received (no
communication), backward sends the gradients back exactly as an uncached dispatch would. The
results are bit-identical to re-sending: the cached rows are the bytes the all-to-all delivered."""

import torch

from ..kernels import dequantize_mxfp4
from ..tensors import MXFP4Tensor
from .all_to_all import all_to_all_rows, send_gradient_back


class _ReplayTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, cached_rows, hidden, splits, group, scale_rule, grad_format):
        ctx.splits, ctx.group, ctx.grad_format, ctx.input_dtype = splits, group, grad_format, tokens.dtype
        return dequantize_mxfp4(MXFP4Tensor(cached_rows, hidden, scale_rule)).to(tokens.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        grad = send_gradient_back(grad_output, ctx.splits, ctx.group, ctx.grad_format)
        return grad.to(ctx.input_dtype), None, None, None, None, None, None


class _ReplayRows(torch.autograd.Function):
    """For the routing probs: the cached received rows forward, the reversed all-to-all backward."""

    @staticmethod
    def forward(ctx, sent, cached_received, splits, group):
        ctx.splits, ctx.group = splits, group
        return cached_received.clone()

    @staticmethod
    def backward(ctx, grad_output):
        output_splits, input_splits = ctx.splits
        return all_to_all_rows(grad_output.contiguous(), input_splits, output_splits, ctx.group), None, None, None


def replay_tokens(tokens: torch.Tensor, cached: MXFP4Tensor, output_splits, input_splits, group,
                  grad_format: str) -> torch.Tensor:
    """tokens: this pass's permuted tokens (only their gradient path is used)."""
    splits = (list(output_splits), list(input_splits))
    return _ReplayTokens.apply(tokens, cached.rows, cached.hidden, splits, group, cached.scale_rule, grad_format)


def replay_rows(sent: torch.Tensor, cached_received: torch.Tensor, output_splits, input_splits, group) -> torch.Tensor:
    return _ReplayRows.apply(sent, cached_received, (list(output_splits), list(input_splits)), group)


__all__ = ["replay_rows", "replay_tokens"]
