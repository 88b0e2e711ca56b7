"""SwiGLU with the routing probabilities, as Megatron's expert MLP applies them
(silu(x_glu) * (x_linear + offset) * prob), computed in fp32 over all tokens at once, and its
backward.

Forward: on CUDA through torch.compile (as Megatron's own SwiGLU goes through its jit_fuser), one
kernel and no fp32 [tokens, 2 x FFN] temporary; the FP8 linears' MLP uses it (the routed experts
use swiglu_forward.py, which also writes the quantized copies they need). Backward: a Triton kernel that reads the SwiGLU
input and the gradient once and writes the input gradient and the probs' gradient (the row sums)
in the same pass; torch.compile made two kernels of it, reading the input twice. On CPU without
Triton's interpreter both run eagerly, with the same arithmetic.
"""

from typing import Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._bits import store_rounded
from ._checks import interpreter_enabled
from ._sm90_spec import BuildVariant, KernelSpec

_compiled: Dict[Callable, Callable] = {}
# Rows per program of the backward kernel; the interpreter's cost is per program (swiglu_forward.py
# does the same): 64 rows took 5-10x less time than 4 at the tests' shapes.
GPU_BLOCK_ROWS, INTERPRETER_BLOCK_ROWS = 4, 64


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


def swiglu_with_probs_backward_eager(fc1_out: torch.Tensor, probs: torch.Tensor, grad: torch.Tensor,
                                     offset: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """(gradient of fc1_out in grad's dtype, gradient of probs in probs' dtype) given the gradient
    of the output: the definition, in torch ops."""
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


@triton.jit
def _swiglu_backward_kernel(fc1_out_ptr, probs_ptr, grad_ptr, grad_fc1_out_ptr, grad_probs_ptr, num_rows, offset,
                            FFN: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_FFN: tl.constexpr,
                            GRAD_BF16: tl.constexpr, PROBS_BF16: tl.constexpr):
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = row < num_rows
    row64 = row.to(tl.int64)[:, None]
    prob = tl.load(probs_ptr + row, mask=row_ok, other=0).to(tl.float32)[:, None]
    grad_prob = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    for start in tl.static_range(0, FFN, BLOCK_FFN):
        col = start + tl.arange(0, BLOCK_FFN)[None, :]
        mask = row_ok[:, None] & (col < FFN)
        gate_at = fc1_out_ptr + row64 * (2 * FFN) + col
        gate = tl.load(gate_at, mask=mask, other=0).to(tl.float32)
        linear = tl.load(gate_at + FFN, mask=mask, other=0).to(tl.float32) + offset
        grad = tl.load(grad_ptr + row64 * FFN + col, mask=mask, other=0).to(tl.float32)
        sigmoid = 1.0 / (1.0 + tl.exp(-gate))
        silu = gate * sigmoid
        grad_prob += tl.sum(grad * silu * linear, axis=1)
        grad_act = grad * prob
        grad_gate = grad_act * linear * sigmoid * (1 + gate * (1 - sigmoid))
        out_at = grad_fc1_out_ptr + row64 * (2 * FFN) + col
        store_rounded(out_at, grad_gate, mask, GRAD_BF16)
        store_rounded(out_at + FFN, grad_act * silu, mask, GRAD_BF16)
    store_rounded(grad_probs_ptr + row, grad_prob, row_ok, PROBS_BF16)


def swiglu_with_probs_backward(fc1_out: torch.Tensor, probs: torch.Tensor, grad: torch.Tensor,
                               offset: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """swiglu_with_probs_backward_eager in one Triton kernel (on CUDA, or on CPU under Triton's
    interpreter); equal to it up to fp32 rounding (exp and the row sums' order)."""
    if not (fc1_out.is_cuda or interpreter_enabled()):
        return swiglu_with_probs_backward_eager(fc1_out, probs, grad, offset)
    num_rows, ffn = grad.shape
    if fc1_out.shape != (num_rows, 2 * ffn) or probs.shape != (num_rows,):
        raise ValueError(f"SwiGLU backward: fc1_out {tuple(fc1_out.shape)}, probs {tuple(probs.shape)} and gradient "
                         f"{tuple(grad.shape)} do not match ([T, 2F], [T], [T, F])")
    fc1_out, probs, grad = fc1_out.contiguous(), probs.contiguous(), grad.contiguous()
    grad_fc1_out = torch.empty(num_rows, 2 * ffn, dtype=grad.dtype, device=grad.device)
    grad_probs = torch.empty(num_rows, dtype=probs.dtype, device=grad.device)
    block_rows = GPU_BLOCK_ROWS if grad.is_cuda else INTERPRETER_BLOCK_ROWS
    if num_rows:
        grad_bf16, probs_bf16 = grad.dtype == torch.bfloat16, probs.dtype == torch.bfloat16
        _swiglu_backward_kernel[(triton.cdiv(num_rows, block_rows),)](
            fc1_out, probs, grad, grad_fc1_out.view(torch.int16) if grad_bf16 else grad_fc1_out,
            grad_probs.view(torch.int16) if probs_bf16 else grad_probs, num_rows, float(offset),
            FFN=ffn, BLOCK_ROWS=block_rows, BLOCK_FFN=min(1024, triton.next_power_of_2(ffn)),
            GRAD_BF16=grad_bf16, PROBS_BF16=probs_bf16, num_warps=4)
    return grad_fc1_out, grad_probs


def sm90_specs(variant: BuildVariant) -> List[KernelSpec]:
    """The backward kernel at FFN 2048 (BF16 gradients, fp32 probs), as sm90_build compiles it;
    the same for every variant (no hidden size, no MXFP4 in it)."""
    ffn, block_rows = 2048, GPU_BLOCK_ROWS
    return [KernelSpec(
        "swiglu_backward", _swiglu_backward_kernel,
        {"fc1_out_ptr": "*bf16", "probs_ptr": "*fp32", "grad_ptr": "*bf16", "grad_fc1_out_ptr": "*i16",
         "grad_probs_ptr": "*fp32", "num_rows": "i32", "offset": "fp32"},
        {"FFN": ffn, "BLOCK_ROWS": block_rows, "BLOCK_FFN": 1024, "GRAD_BF16": True, "PROBS_BF16": False},
        4, block_rows * ffn)]
