"""A float64 oracle of the FP8 experts (tests only): the same quantization steps as
megatron_fp4.experts, written with megatron_fp4.reference, products in float64. Module and oracle
then differ only in accumulation precision and where an intermediate rounds at a BF16 tie."""

from dataclasses import dataclass
from typing import List, Optional

import torch

from megatron_fp4 import reference as ref
from megatron_fp4.tensors import MXFP4Tensor

F64 = torch.float64


@dataclass
class ExpertsResult:
    output: torch.Tensor
    grad_input: torch.Tensor
    grad_probs: torch.Tensor
    grad_fc1: List[torch.Tensor]
    grad_fc2: List[torch.Tensor]


def _rows(t: torch.Tensor) -> torch.Tensor:
    return ref.dequantize_fp8(ref.quantize_fp8_rows(t), F64)


def _weight(w: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    return ref.dequantize_fp8_weight(ref.quantize_fp8_weight(w, transpose), F64)


def _fp4_round(t: torch.Tensor) -> torch.Tensor:
    return ref.dequantize_mxfp4(ref.quantize_mxfp4(t))


def _swiglu(fc1_out, probs, offset):
    gate, linear = fc1_out.to(F64).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * (linear + offset) * probs.to(F64).unsqueeze(-1)


def fp8_experts_oracle(tokens: torch.Tensor, payload: Optional[MXFP4Tensor], counts: List[int], probs,
                       fc1: List[torch.Tensor], fc2: List[torch.Tensor], grad_output,
                       offset: float = 0.0, fp4_activations: bool = True) -> ExpertsResult:
    """Forward and backward of the FP8 experts. With a payload the input operand is its exact FP8
    conversion and the SwiGLU / fc2 inputs are kept in MXFP4 (unless fp4_activations is False, as
    inside Megatron's recompute); without, all three are kept at their BF16 values."""
    bf16 = tokens.dtype
    ffn = fc2[0].shape[1]
    starts = [0]
    for n in counts:
        starts.append(starts[-1] + n)
    x = ref.dequantize_fp8(ref.mxfp4_to_fp8_rows(payload), F64) if payload is not None else _rows(tokens)
    fc1_out = torch.zeros(len(tokens), 2 * ffn, dtype=bf16)
    for e, n in enumerate(counts):
        if n:
            fc1_out[starts[e] : starts[e + 1]] = (x[starts[e] : starts[e + 1]] @ _weight(fc1[e]).t()).to(bf16)
    fc2_in = _swiglu(fc1_out, probs, offset).to(bf16)
    h = _rows(fc2_in)
    output = torch.zeros(len(tokens), tokens.shape[1], dtype=bf16)
    for e, n in enumerate(counts):
        if n:
            output[starts[e] : starts[e + 1]] = (h[starts[e] : starts[e + 1]] @ _weight(fc2[e]).t()).to(bf16)

    # Backward, from what was saved.
    fp4_acts = payload is not None and fp4_activations
    saved_fc1_out = _fp4_round(fc1_out) if fp4_acts else fc1_out
    saved_fc2_in = _fp4_round(fc2_in) if fp4_acts else fc2_in
    saved_input = ref.dequantize_mxfp4(payload) if payload is not None else tokens
    g_rows = _rows(grad_output)
    grad_fc2_in = torch.zeros(len(tokens), ffn, dtype=bf16)
    grad_fc2 = []
    for e, n in enumerate(counts):
        rows = slice(starts[e], starts[e + 1])
        grad_fc2_in[rows] = (g_rows[rows] @ _weight(fc2[e], transpose=True).t()).to(bf16)
        # The wgrad operands are 1x128 blocks along each expert's tokens (padded with zeros).
        g_cols = ref.dequantize_fp8(ref.quantize_fp8_cols(grad_output[rows], [n]), F64)[:, :n]
        h_cols = _fp8_columns(saved_fc2_in[rows], n, fp4_acts)
        grad_fc2.append((g_cols @ h_cols.t()).to(bf16))
    fc1_out_b = saved_fc1_out.to(F64).requires_grad_(True)
    probs_b = probs.to(F64).requires_grad_(True)
    _swiglu(fc1_out_b, probs_b, offset).backward(grad_fc2_in.to(F64))
    grad_fc1_out = fc1_out_b.grad.to(bf16)
    g_rows = _rows(grad_fc1_out)
    grad_input = torch.zeros_like(tokens)
    grad_fc1 = []
    for e, n in enumerate(counts):
        rows = slice(starts[e], starts[e + 1])
        grad_input[rows] = (g_rows[rows] @ _weight(fc1[e], transpose=True).t()).to(bf16)
        g_cols = ref.dequantize_fp8(ref.quantize_fp8_cols(grad_fc1_out[rows], [n]), F64)[:, :n]
        grad_fc1.append((g_cols @ _fp8_columns(saved_input[rows], n, payload is not None).t()).to(bf16))
    return ExpertsResult(output, grad_input, probs_b.grad.to(probs.dtype), grad_fc1, grad_fc2)


def _fp8_columns(values: torch.Tensor, n: int, from_fp4: bool) -> torch.Tensor:
    """One expert's [n, W] activations as the wgrad's 1x128-along-tokens operand, [W, n] float64."""
    if from_fp4:
        cols = ref.mxfp4_to_fp8_cols(ref.quantize_mxfp4(values), [n])
    else:
        cols = ref.quantize_fp8_cols(values, [n])
    return ref.dequantize_fp8(cols, F64)[:, :n]
