"""A float64 oracle of an FP8 linear layer (tests only): the quantization steps of
megatron_fp4.linears written with megatron_fp4.reference, products in float64."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_fp4 import reference as ref

F64 = torch.float64


@dataclass
class LinearResult:
    output: torch.Tensor
    grad_input: torch.Tensor
    grad_weight: torch.Tensor


def _rows(t: torch.Tensor) -> torch.Tensor:
    return ref.dequantize_fp8(ref.quantize_fp8_rows(t), F64)


def _weight(w: torch.Tensor) -> torch.Tensor:
    """W's 128x128-block FP8 values, [N, K] float64; W zero-padded to a multiple of 128 rows first."""
    pad = -w.shape[0] % 128
    padded = F.pad(w, (0, 0, 0, pad))
    return ref.dequantize_fp8_weight(ref.quantize_fp8_weight(padded), F64)[: w.shape[0]]


def _columns(values: torch.Tensor) -> torch.Tensor:
    """[T, W] as the wgrad's 1x128-along-tokens operand: [W, T] float64."""
    return ref.dequantize_fp8(ref.quantize_fp8_cols(values, [values.shape[0]]), F64)[:, : values.shape[0]]


def fp8_linear_oracle(x: torch.Tensor, weight: torch.Tensor, grad_output: torch.Tensor, mxfp4_saved: bool,
                      scale_rule: str = "ceil") -> LinearResult:
    """Y = X W^T and its gradients for 2-D x [T, K], weight [N, K], grad_output [T, N]. The saved
    input is x's FP8 columns, or its MXFP4 values (whose FP8 columns are exact, docs/design.md §3.2)."""
    dtype = x.dtype
    output = (_rows(x) @ _weight(weight).t()).to(dtype)
    grad_input = (_rows(F.pad(grad_output, (0, -grad_output.shape[1] % 128))) @
                  F.pad(_weight(weight), (0, 0, 0, -weight.shape[0] % 128))).to(dtype)
    saved = ref.dequantize_mxfp4(ref.quantize_mxfp4(x, scale_rule)) if mxfp4_saved else x
    grad_weight = (_columns(grad_output) @ _columns(saved).t()).to(dtype)
    return LinearResult(output, grad_input, grad_weight)


def swiglu_oracle(fc1_out: torch.Tensor, grad_output: torch.Tensor, offset: float):
    """(output, gradient of fc1_out) of SwiGLU in float64, the backward from fc1_out's MXFP4 values."""
    def swiglu(t):
        gate, linear = t.chunk(2, dim=-1)
        return F.silu(gate) * (linear + offset)

    output = swiglu(fc1_out.to(F64)).to(fc1_out.dtype)
    saved = ref.dequantize_mxfp4(ref.quantize_mxfp4(fc1_out)).to(F64).requires_grad_(True)
    swiglu(saved).backward(grad_output.to(F64))
    return output, saved.grad.to(fc1_out.dtype)
