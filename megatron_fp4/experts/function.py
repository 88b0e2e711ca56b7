"""The experts' forward and backward as one autograd function over all local experts.

Forward, per expert segment: fc1 = X W1^T in FP8 (X from the MXFP4 payload by the exact
FP4 -> FP8 row conversion, or quantized from BF16 for the FP8 baseline), SwiGLU times the probs,
fc2 = H W2^T in FP8 from 1x128 rows of H. Weights are quantized to 128x128 blocks per use (all
experts of a linear in one launch), never kept. Saved for backward: with a payload, the payload
itself and MXFP4 copies of the SwiGLU input and the fc2 input (nothing tokens x hidden or tokens x
FFN in BF16); without one (the FP8 baseline), the same three tensors in BF16.

Backward: dgrad in FP8 (gradient 1x128 rows, weights transposed 128x128); wgrad in FP8 with both
operands 1x128 along tokens per expert segment (the column kernels). Weight gradients go to
main_grad when Megatron fuses gradient accumulation, as its own linear layers do.
"""

from dataclasses import dataclass
from typing import List, Optional

import torch

from .. import kernels as K
from ..telemetry import Telemetry
from ..tensors import FP8BlockWeight, MXFP4Tensor
from .gemm import M_MULTIPLE, columns_segment, columns_segment_as_b, gemm_1x128, gemm_by_weight, rows_segments
from .segments import ExpertSegments
from .swiglu import swiglu_with_probs, swiglu_with_probs_backward


@dataclass(frozen=True)
class ExpertsCall:
    """What one forward needs besides tensors."""

    segments: ExpertSegments
    scale_rule: str  # MXFP4 rule of the saved activations (the dispatch's own rule)
    glu_offset: float
    accumulate_in_main_grad: bool  # Megatron's gradient_accumulation_fusion
    backward_follows: bool = True  # False: a no-grad forward (eval, a checkpointed first pass) saves nothing
    telemetry: Optional[Telemetry] = None  # counts the MXFP4 activations saved for backward


# One dummy weight gradient per shape, dtype, device and fill, shared by all experts and layers
# (as Transformer Engine does): DDP only looks at it to skip its own accumulation.
_dummy_grads = {}


def _dummy_grad(param: torch.Tensor, dtype, zero: bool) -> torch.Tensor:
    key = (tuple(param.shape), dtype, param.device, zero)
    if key not in _dummy_grads:
        make = torch.zeros if zero else torch.empty
        _dummy_grads[key] = make(param.shape, dtype=dtype, device=param.device)
    return _dummy_grads[key]


def weight_gradient(param: torch.Tensor, grad: Optional[torch.Tensor], dtype,
                    accumulate_in_main_grad: bool) -> Optional[torch.Tensor]:
    """What backward returns for `param` (grad None: the expert had no tokens, a zero gradient).
    With fused accumulation the gradient is added to param.main_grad here, and (as Megatron's linear
    layers do under DDP) a shared dummy is returned so that DDP's hook, which sees
    grad_added_to_main_grad, runs on the main thread and adds nothing."""
    if not (accumulate_in_main_grad and getattr(param, "main_grad", None) is not None):
        return torch.zeros_like(param) if grad is None else grad.to(param.dtype)
    if grad is not None:
        # The GEMM's BF16 output is added in fp32: one more BF16 rounding per micro-batch than
        # Megatron's fused fp32 wgrad (its unfused path rounds the same way).
        param.main_grad.add_(grad)
    if not hasattr(param, "grad_added_to_main_grad"):
        return None
    param.grad_added_to_main_grad = True
    return _dummy_grad(param, dtype, zero=getattr(param, "zero_out_wgrad", False))


class FP8ExpertsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: ExpertsCall, tokens, probs, payload_rows, *weights):
        segments = call.segments
        num_experts = len(segments.counts)
        fc1_weights, fc2_weights = weights[:num_experts], weights[num_experts:]
        num_tokens, hidden = tokens.shape
        ffn = fc2_weights[0].shape[1]
        dtype = tokens.dtype

        if payload_rows is not None:
            input_rows = K.mxfp4_to_fp8_rows(MXFP4Tensor(payload_rows, hidden, call.scale_rule))
        else:
            input_rows = K.quantize_fp8_rows(tokens)
        fc1_out = _linear_forward(segments, input_rows, fc1_weights, dtype)
        del input_rows
        fc2_in = swiglu_with_probs(fc1_out, probs, call.glu_offset, dtype)  # row-wise: all experts at once
        output = _linear_forward(segments, K.quantize_fp8_rows(fc2_in), fc2_weights, dtype)

        if not call.backward_follows:
            return output
        if payload_rows is not None:
            saved = (payload_rows, K.quantize_mxfp4(fc1_out, call.scale_rule).rows,
                     K.quantize_mxfp4(fc2_in, call.scale_rule).rows)
        else:
            saved = (tokens, fc1_out, fc2_in)
        ctx.save_for_backward(*saved, probs, *weights)
        # Bytes of the MXFP4 activations kept for backward (uint8 rows), for the telemetry.
        ctx.fp4_bytes = sum(rows.numel() for rows in saved) if payload_rows is not None else 0
        if call.telemetry is not None:
            call.telemetry.hold(ctx.fp4_bytes)
        ctx.call = call
        ctx.from_payload = payload_rows is not None
        ctx.sizes = (hidden, ffn)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        call = ctx.call
        segments = call.segments
        hidden, ffn = ctx.sizes
        saved_input, saved_fc1_out, saved_fc2_in, probs, *weights = ctx.saved_tensors
        num_experts = len(segments.counts)
        fc1_weights, fc2_weights = weights[:num_experts], weights[num_experts:]
        dtype = grad_output.dtype

        def deliver(param, grad):
            # Into main_grad at once when fused, so that each expert's gradient is freed in the loop.
            return weight_gradient(param, grad, dtype, call.accumulate_in_main_grad)

        if segments.num_tokens == 0:  # a rank that received no tokens this step
            _release_saved_fp4(ctx)
            grad_input = grad_output.new_zeros(0, hidden)
            return (None, grad_input, torch.zeros_like(probs), None, *_with_empty_experts([], weights, deliver))
        grad_output = grad_output.contiguous()
        counts = segments.counts_device

        def mxfp4(rows, width):
            return MXFP4Tensor(rows, width, call.scale_rule)

        # fc2: dgrad and wgrad.
        if ctx.from_payload:
            fc2_in_cols = K.mxfp4_to_fp8_cols(mxfp4(saved_fc2_in, ffn), counts, check_counts=False)
            fc1_out = K.dequantize_mxfp4(mxfp4(saved_fc1_out, 2 * ffn))
        else:
            fc2_in_cols = K.quantize_fp8_cols(saved_fc2_in, counts, check_counts=False)
            fc1_out = saved_fc1_out
        grad_fc2_in, grad_fc2 = _linear_backward(segments, grad_output, fc2_in_cols, fc2_weights, deliver)
        del fc2_in_cols
        grad_fc1_out, grad_probs = swiglu_with_probs_backward(fc1_out, probs, grad_fc2_in, call.glu_offset)
        del fc1_out, grad_fc2_in

        # fc1: dgrad and wgrad.
        if ctx.from_payload:
            input_cols = K.mxfp4_to_fp8_cols(mxfp4(saved_input, hidden), counts, check_counts=False)
        else:
            input_cols = K.quantize_fp8_cols(saved_input, counts, check_counts=False)
        grad_input, grad_fc1 = _linear_backward(segments, grad_fc1_out, input_cols, fc1_weights, deliver)
        del grad_fc1_out, input_cols
        _release_saved_fp4(ctx)
        return (None, grad_input, grad_probs, None, *_with_empty_experts(grad_fc1 + grad_fc2, weights, deliver))


def _release_saved_fp4(ctx) -> None:
    """Tell the telemetry that the MXFP4 activations forward counted have been used."""
    if ctx.call.telemetry is not None:
        ctx.call.telemetry.release(ctx.fp4_bytes)


def _products_by_weight(segments: ExpertSegments, rows, weights: List[Optional[FP8BlockWeight]], width: int,
                        dtype) -> torch.Tensor:
    """[tokens, width]: each expert segment's rows times its weight (128x128 blocks, [N, K]), each GEMM
    writing straight into the result. A segment's M is padded to a multiple of 4 (rows_segments), so
    its last product rows spill into the next segment's, which the next expert overwrites (they
    run in order), or into the spare rows past the end."""
    buffer = torch.empty(segments.num_tokens + M_MULTIPLE - 1, width, dtype=dtype,
                         device=rows.data.device)
    busy = list(segments.non_empty())
    operands = rows_segments(rows, [(first, end) for _, first, end, _, _ in busy])
    for (expert, first, *_), (a, scale_a) in zip(busy, operands):
        gemm_by_weight(a, scale_a, weights[expert], dtype, out=buffer[first : first + a.shape[0]])
    return buffer[: segments.num_tokens]


def _linear_forward(segments: ExpertSegments, rows, weights, dtype) -> torch.Tensor:
    """Y = X W_e^T for every expert segment, in FP8 (X in 1x128 rows, W_e in 128x128 blocks)."""
    return _products_by_weight(segments, rows, _quantized(segments, weights), weights[0].shape[0], dtype)


def _quantized(segments: ExpertSegments, weights, transpose: bool = False) -> List[Optional[FP8BlockWeight]]:
    """The 128x128 FP8 blocks of the weights of experts with tokens (one launch), None for the others."""
    busy = [expert for expert, *_ in segments.non_empty()]
    quantized: List[Optional[FP8BlockWeight]] = [None] * len(weights)
    if not busy:
        return quantized
    for expert, weight in zip(busy, K.quantize_fp8_weights([weights[e] for e in busy], transpose)):
        quantized[expert] = weight
    return quantized


def _linear_backward(segments: ExpertSegments, grad: torch.Tensor, input_cols, weights, deliver):
    """Backward of Y = X W_e^T for every expert segment, in FP8: dX (gradient 1x128 rows times W_e
    in 128x128 blocks, transposed) into one [tokens, in] buffer, and dW_e (gradient and input both
    1x128 along the segment's tokens), delivered one expert at a time. Experts without tokens get None."""
    dtype = grad.dtype
    grad_input = _products_by_weight(segments, K.quantize_fp8_rows(grad), _quantized(segments, weights, transpose=True),
                                     weights[0].shape[1], dtype)
    grad_cols = K.quantize_fp8_cols(grad, segments.counts_device, check_counts=False)
    grad_weights: List[Optional[torch.Tensor]] = [None] * len(weights)
    for expert, _, _, col, col_end in segments.non_empty():
        grad_weights[expert] = deliver(weights[expert], gemm_1x128(
            *columns_segment(grad_cols, col, col_end), *columns_segment_as_b(input_cols, col, col_end), dtype))
    return grad_input, grad_weights


def _with_empty_experts(grads: List[Optional[torch.Tensor]], weights, deliver) -> list:
    """The weight gradients to return: experts that had no tokens (None, or missing) get a zero gradient."""
    grads = grads or [None] * len(weights)
    return [deliver(param, None) if grad is None else grad for param, grad in zip(weights, grads)]
