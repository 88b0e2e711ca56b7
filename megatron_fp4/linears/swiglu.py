"""SwiGLU that keeps its input (the fc1 output, [tokens, 2F]) in MXFP4 for backward: the paper's
storage for the dense MLP and the shared experts (docs/design.md §6.3).

Megatron's MLP calls it as its activation module (the `activation_func` submodule, which MLP uses
when the config's use_te_activation_func is set). The arithmetic is the routed experts' SwiGLU
(kernels/swiglu.py) with every routing probability 1: fp32 inside, one rounding at the end; the
backward sees the MXFP4 values of the input, not the BF16 ones.
"""

import torch

from .. import kernels as K
from ..kernels.swiglu import swiglu_with_probs, swiglu_with_probs_backward
from ..tensors import MXFP4Tensor


def _unit_probs(rows: torch.Tensor) -> torch.Tensor:
    return torch.ones(rows.shape[0], dtype=torch.float32, device=rows.device)


class MXFP4SavedSwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fc1_out: torch.Tensor, offset: float, scale_rule: str, backward_follows: bool):
        width = fc1_out.shape[-1]
        rows = fc1_out.reshape(-1, width).contiguous()
        output = swiglu_with_probs(rows, _unit_probs(rows), offset, fc1_out.dtype)
        if backward_follows:
            ctx.save_for_backward(K.quantize_mxfp4(rows, scale_rule).rows)
            ctx.offset, ctx.scale_rule, ctx.width = offset, scale_rule, width
        return output.view(*fc1_out.shape[:-1], width // 2)

    @staticmethod
    def backward(ctx, grad_output):
        (saved,) = ctx.saved_tensors
        fc1_out = K.dequantize_mxfp4(MXFP4Tensor(saved, ctx.width, ctx.scale_rule))
        grad = grad_output.reshape(-1, ctx.width // 2).contiguous()
        grad_fc1_out, _ = swiglu_with_probs_backward(fc1_out, _unit_probs(fc1_out), grad, ctx.offset)
        return grad_fc1_out.view(*grad_output.shape[:-1], ctx.width), None, None, None


class MXFP4SavedSwiGLU(torch.nn.Module):
    """silu(gate) * (linear + glu_linear_offset) over the fc1 output's two halves."""

    def __init__(self, config, scale_rule: str):
        super().__init__()
        self.offset = float(config.glu_linear_offset)
        self.scale_rule = scale_rule

    def forward(self, fc1_out: torch.Tensor) -> torch.Tensor:
        backward_follows = torch.is_grad_enabled() and fc1_out.requires_grad
        return MXFP4SavedSwiGLUFunction.apply(fc1_out, self.offset, self.scale_rule, backward_follows)
