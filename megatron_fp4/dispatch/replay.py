"""The recompute pass of a cached dispatch: forward hands back what the first pass received (no
communication), backward sends the gradients back exactly as an uncached dispatch would. The
results are bit-identical to re-sending: the cached rows are the bytes the all-to-all delivered."""

import torch

from ..tensors import MXFP4Tensor
from .all_to_all import received_tokens, send_gradient_back


class _ReplayTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, cached_rows, hidden, splits, group, scale_rule, grad_format, dequantize):
        ctx.splits, ctx.group, ctx.grad_format, ctx.input_dtype = splits, group, grad_format, tokens.dtype
        return received_tokens(MXFP4Tensor(cached_rows, hidden, scale_rule), tokens.dtype, dequantize)

    @staticmethod
    def backward(ctx, grad_output):
        grad = send_gradient_back(grad_output, ctx.splits, ctx.group, ctx.grad_format)
        return grad.to(ctx.input_dtype), None, None, None, None, None, None, None


def replay_tokens(tokens: torch.Tensor, cached: MXFP4Tensor, output_splits, input_splits, group,
                  grad_format, dequantize: bool = True) -> torch.Tensor:
    """tokens: this pass's permuted tokens (only their gradient path is used). dequantize as in
    fp4_dispatch_all_to_all."""
    splits = (list(output_splits), list(input_splits))
    return _ReplayTokens.apply(tokens, cached.rows, cached.hidden, splits, group, cached.scale_rule, grad_format,
                               dequantize)


__all__ = ["replay_tokens"]
