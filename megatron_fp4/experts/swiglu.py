"""SwiGLU with the routing probabilities, as Megatron's expert MLP applies them
(silu(x_glu) * (x_linear + offset) * prob), computed in fp32 over all tokens at once, and its
backward.

On CUDA both run through torch.compile (as Megatron's own SwiGLU does through its jit_fuser): the
fp32 steps fuse into one kernel each way and no fp32 [tokens, 2 x FFN] temporary is written to
memory. On CPU (tests) they run eagerly; the arithmetic is the same.
"""

from typing import Callable, Dict

import torch
import torch.nn.functional as F

_compiled: Dict[Callable, Callable] = {}


def _fused_on_cuda(fn: Callable) -> Callable:
    def call(first: torch.Tensor, *args):
        if not first.is_cuda:
            return fn(first, *args)
        if fn not in _compiled:
            # dynamic: the token count changes every step.
            _compiled[fn] = torch.compile(fn, dynamic=True)
        return _compiled[fn](first, *args)

    call.__doc__ = fn.__doc__
    return call


@_fused_on_cuda
def swiglu_with_probs(fc1_out: torch.Tensor, probs: torch.Tensor, offset: float, out_dtype: torch.dtype):
    """fc1_out [T, 2F], probs [T] -> [T, F] in out_dtype."""
    gate, linear = fc1_out.float().chunk(2, dim=-1)
    return (F.silu(gate) * (linear + offset) * probs.float().unsqueeze(-1)).to(out_dtype)


@_fused_on_cuda
def swiglu_with_probs_backward(fc1_out: torch.Tensor, probs: torch.Tensor, grad: torch.Tensor, offset: float):
    """(gradient of fc1_out in grad's dtype, gradient of probs in probs' dtype) given the gradient
    of the output."""
    gate, linear = fc1_out.float().chunk(2, dim=-1)
    linear = linear + offset
    sigmoid = torch.sigmoid(gate)
    silu = gate * sigmoid
    grad32 = grad.float()
    grad_probs = (grad32 * silu * linear).sum(dim=-1)
    grad_act = grad32 * probs.float().unsqueeze(-1)
    grad_gate = grad_act * linear * sigmoid * (1 + gate * (1 - sigmoid))
    grad_fc1_out = torch.cat([grad_gate, grad_act * silu], dim=-1)
    return grad_fc1_out.to(grad.dtype), grad_probs.to(probs.dtype)
