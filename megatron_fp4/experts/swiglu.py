"""SwiGLU with the routing probabilities, as Megatron's expert MLP applies them
(silu(x_glu) * (x_linear + offset) * prob), in fp32, and its backward for one expert segment."""

import torch
import torch.nn.functional as F


def swiglu_with_probs(fc1_out: torch.Tensor, probs: torch.Tensor, offset: float) -> torch.Tensor:
    gate, linear = fc1_out.float().chunk(2, dim=-1)
    return F.silu(gate) * (linear + offset) * probs.float().unsqueeze(-1)


def swiglu_with_probs_backward(fc1_out: torch.Tensor, probs: torch.Tensor, grad: torch.Tensor, offset: float):
    """(gradient of fc1_out in fp32, gradient of probs in fp32) given the gradient of the output."""
    gate, linear = fc1_out.float().chunk(2, dim=-1)
    linear = linear + offset
    sigmoid = torch.sigmoid(gate)
    silu = gate * sigmoid
    grad = grad.float()
    grad_probs = (grad * silu * linear).sum(dim=-1)
    grad_act = grad * probs.float().unsqueeze(-1)
    grad_gate = grad_act * linear * sigmoid * (1 + gate * (1 - sigmoid))
    return torch.cat([grad_gate, grad_act * silu], dim=-1), grad_probs
