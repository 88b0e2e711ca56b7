"""Megatron's fused gradient accumulation, as our FP8 GEMMs take part in it: with
gradient_accumulation_fusion each parameter carries an fp32 `main_grad` buffer that the weight
gradient is added into, and backward returns a dummy gradient so that DDP adds nothing."""

from typing import Optional

import torch

# One dummy weight gradient per shape, dtype, device and fill, shared by all experts and layers
# (as Transformer Engine does): DDP only looks at it to skip its own accumulation.
_dummy_grads = {}


def _dummy_grad(param: torch.Tensor, dtype, zero: bool) -> torch.Tensor:
    key = (tuple(param.shape), dtype, param.device, zero)
    if key not in _dummy_grads:
        make = torch.zeros if zero else torch.empty
        _dummy_grads[key] = make(param.shape, dtype=dtype, device=param.device)
    return _dummy_grads[key]


def added_to_main_grad(param: torch.Tensor, dtype) -> Optional[torch.Tensor]:
    """What backward returns for a parameter whose gradient went into main_grad: as Megatron's linear
    layers do under DDP, a shared dummy, so that DDP's hook, which sees grad_added_to_main_grad,
    runs on the main thread and adds nothing."""
    if not hasattr(param, "grad_added_to_main_grad"):
        return None
    param.grad_added_to_main_grad = True
    return _dummy_grad(param, dtype, zero=getattr(param, "zero_out_wgrad", False))


def fused_main_grads(params, accumulate_in_main_grad: bool) -> Optional[list]:
    """The parameters' main_grad buffers when Megatron fuses gradient accumulation, else None."""
    main_grads = [getattr(param, "main_grad", None) for param in params]
    if accumulate_in_main_grad and all(g is not None for g in main_grads):
        return main_grads
    return None
