"""SwiGLU with the routing probabilities, as Megatron's expert MLP applies them
(silu(x_glu) * (x_linear + offset) * prob), computed in fp32 over all tokens at once, and its
backward.

Forward: on CUDA through torch.compile (as Megatron's own SwiGLU goes through its jit_fuser), one
kernel and no fp32 [tokens, 2 x FFN] temporary. Backward: a Triton kernel that reads the SwiGLU
input and the gradient once and writes the input gradient and the probs' gradient (the row sums)
in the same pass; torch.compile made two kernels of it, reading the input twice. On CPU without
Triton's interpreter both run eagerly, with the same arithmetic.
"""

from typing import Callable, Dict, List, Tuple, Union

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..kernels import dequantize_mxfp4
from ..kernels._bits import store_rounded
from ..kernels.mxfp4_dequantize import mxfp4_columns
from ..tensors import MXFP4Tensor
from ..kernels._checks import interpreter_enabled
from ..kernels._sm90_spec import BuildVariant, KernelSpec

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
def _fc1_out_columns(fc1_out_ptr, row_at, row_ok, start, col, mask, FFN: tl.constexpr, FC1_MXFP4: tl.constexpr,
                     BLOCK_ROWS: tl.constexpr, BLOCK_FFN: tl.constexpr):
    """(gate, linear) columns `col` (= start + arange(BLOCK_FFN)) of fc1_out's rows in fp32, from BF16
    rows or MXFP4 wire rows (row_at: the rows' offsets [BLOCK_ROWS, 1], in elements or bytes)."""
    if FC1_MXFP4:
        blocks_left = (FFN - start) // 32
        return (mxfp4_columns(fc1_out_ptr, row_at, row_ok, start // 32, blocks_left, 2 * FFN, BLOCK_ROWS,
                              BLOCK_FFN // 32),
                mxfp4_columns(fc1_out_ptr, row_at, row_ok, (FFN + start) // 32, blocks_left, 2 * FFN, BLOCK_ROWS,
                              BLOCK_FFN // 32))
    gate_at = fc1_out_ptr + row_at + col
    return (tl.load(gate_at, mask=mask, other=0).to(tl.float32),
            tl.load(gate_at + FFN, mask=mask, other=0).to(tl.float32))


@triton.jit
def _swiglu_backward_kernel(fc1_out_ptr, probs_ptr, grad_ptr, grad_fc1_out_ptr, grad_probs_ptr, num_rows, offset,
                            fc1_out_row_stride, FFN: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_FFN: tl.constexpr,
                            GRAD_BF16: tl.constexpr, PROBS_BF16: tl.constexpr, FC1_MXFP4: tl.constexpr):
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = row < num_rows
    row64 = row.to(tl.int64)[:, None]
    prob = tl.load(probs_ptr + row, mask=row_ok, other=0).to(tl.float32)[:, None]
    grad_prob = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    for start in tl.static_range(0, FFN, BLOCK_FFN):
        col = start + tl.arange(0, BLOCK_FFN)[None, :]
        mask = row_ok[:, None] & (col < FFN)
        gate, linear = _fc1_out_columns(fc1_out_ptr, row64 * fc1_out_row_stride, row_ok[:, None], start, col, mask,
                                        FFN, FC1_MXFP4, BLOCK_ROWS, BLOCK_FFN)
        linear = linear + offset
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


def swiglu_with_probs_backward(fc1_out: Union[torch.Tensor, MXFP4Tensor], probs: torch.Tensor, grad: torch.Tensor,
                               offset: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """swiglu_with_probs_backward_eager in one Triton kernel (on CUDA, or on CPU under Triton's
    interpreter); equal to it up to fp32 rounding (exp and the row sums' order). fc1_out may be
    MXFP4 rows (the experts' saved copy): the kernel reads them directly, with the bits of
    dequantizing them to BF16 first."""
    if not (fc1_out.device.type == "cuda" or interpreter_enabled()):
        values = dequantize_mxfp4(fc1_out) if isinstance(fc1_out, MXFP4Tensor) else fc1_out
        return swiglu_with_probs_backward_eager(values, probs, grad, offset)
    num_rows, ffn = grad.shape
    if tuple(fc1_out.shape) != (num_rows, 2 * ffn) or probs.shape != (num_rows,):
        raise ValueError(f"SwiGLU backward: fc1_out {tuple(fc1_out.shape)}, probs {tuple(probs.shape)} and gradient "
                         f"{tuple(grad.shape)} do not match ([T, 2F], [T], [T, F])")
    from_mxfp4 = isinstance(fc1_out, MXFP4Tensor)
    fc1_out = fc1_out.rows.contiguous() if from_mxfp4 else fc1_out.contiguous()
    probs, grad = probs.contiguous(), grad.contiguous()
    grad_fc1_out = torch.empty(num_rows, 2 * ffn, dtype=grad.dtype, device=grad.device)
    grad_probs = torch.empty(num_rows, dtype=probs.dtype, device=grad.device)
    block_rows = 4
    if num_rows:
        grad_bf16, probs_bf16 = grad.dtype == torch.bfloat16, probs.dtype == torch.bfloat16
        _swiglu_backward_kernel[(triton.cdiv(num_rows, block_rows),)](
            fc1_out, probs, grad, grad_fc1_out.view(torch.int16) if grad_bf16 else grad_fc1_out,
            grad_probs.view(torch.int16) if probs_bf16 else grad_probs, num_rows, float(offset), fc1_out.stride(0),
            FFN=ffn, BLOCK_ROWS=block_rows, BLOCK_FFN=min(1024, triton.next_power_of_2(ffn)),
            GRAD_BF16=grad_bf16, PROBS_BF16=probs_bf16, FC1_MXFP4=from_mxfp4, num_warps=4)
    return grad_fc1_out, grad_probs


def sm90_specs(variant: BuildVariant) -> List[KernelSpec]:
    """The backward kernel at FFN 2048 (BF16 gradients, fp32 probs), from BF16 and from MXFP4
    fc1_out rows, as sm90_build compiles it; the same for every variant (no hidden size in it)."""
    ffn, block_rows = 2048, 4
    return [KernelSpec(
        name, _swiglu_backward_kernel,
        {"fc1_out_ptr": pointer, "probs_ptr": "*fp32", "grad_ptr": "*bf16", "grad_fc1_out_ptr": "*i16",
         "grad_probs_ptr": "*fp32", "num_rows": "i32", "offset": "fp32", "fc1_out_row_stride": "i32"},
        {"FFN": ffn, "BLOCK_ROWS": block_rows, "BLOCK_FFN": 1024, "GRAD_BF16": True, "PROBS_BF16": False,
         "FC1_MXFP4": from_mxfp4},
        4, block_rows * ffn)
        for name, pointer, from_mxfp4 in (("swiglu_backward", "*bf16", False),
                                          ("swiglu_backward_mxfp4", "*u8", True))]
