"""The experts' forward and backward as one autograd function over all local experts.

Every GEMM is one grouped FP8 launch over all local experts' ragged token segments
(kernels/grouped_fp8_gemm.py), or one cuBLASLt scaled_mm per expert (ExpertGemms, fp8/gemm.py).
Forward: fc1 = X W1^T (X from the MXFP4 payload by the exact FP4 -> FP8 row conversion, or quantized
from BF16 for the FP8 baseline), SwiGLU times the probs, fc2 = H W2^T from 1x128 rows of H (the
SwiGLU kernel writes them, and the copies of its input and output that backward reads). Weights are
in 128x128 blocks, quantized once per optimizer step (fp8/weight_cache.py; backward quantizes W^T
for its data gradient). Saved for backward: with a payload, the payload itself and MXFP4 copies of
the SwiGLU input and the fc2 input (nothing tokens x hidden or tokens x FFN in BF16); without one
(the FP8 baseline), what its weight gradients read, as Transformer Engine's FP8 layers keep it: the
fc1 and fc2 inputs as FP8 columns (built in forward instead of backward: the same values), and the
SwiGLU input in BF16. Inside Megatron's recompute, and under --moe-fp4-storage none, the payload is
still kept (its values are exact) but the SwiGLU and fc2 inputs are kept as in the baseline: nothing
inexact is stored in FP4 there. Under --moe-fp4-recompute-experts only the fc1 input is kept (the
payload, else the BF16 tokens) and backward runs fc1 and the SwiGLU again for those two.

Backward: dgrad in FP8 (gradient 1x128 rows, weights transposed 128x128); wgrad in FP8 with both
operands 1x128 along tokens (the column kernels' layout), each layer's wgrad first. Each output
gradient is quantized both ways from one read (kernels/fp8_quantize_both.py), as are the FP8
baseline's tokens in forward. With Megatron's fused gradient accumulation the wgrad adds its fp32
sums straight into main_grad, as its own linear layers do.
"""

from dataclasses import dataclass
from enum import Enum
from typing import Optional

import torch

from .. import kernels as K
from ..fp8 import FP8WeightCache, TokenSegments, fp8_weights, segment_products, segment_wgrad
from ..kernels import GemmBackend
from ..kernels.swiglu import swiglu_with_probs_backward
from ..kernels.swiglu_forward import SwiGLUOutputs, swiglu_quantized
from ..main_grad import added_to_main_grad, fused_main_grads
from ..telemetry import Telemetry
from ..tensors import FP8BlockTensor, FP8StackedWeights, MXFP4Tensor


class ExpertGemms(Enum):
    """How the experts' FP8 GEMMs run (both compute the same block-scaled products)."""

    # One launch per GEMM over all local experts (kernels/grouped_fp8_gemm.py): the CUDA C++ kernels on
    # SM90 GPUs for the forward GEMMs and weight gradients, the Triton kernels for the data gradients
    # (faster there: DATA_GRADIENT_BACKEND) and elsewhere (the same bits). Dispatched MXFP4 tokens are
    # converted to an FP8 copy for the fc1 GEMM.
    GROUPED = "grouped"
    GROUPED_TRITON = "grouped_triton"  # GROUPED on the Triton kernels on every GPU
    PER_EXPERT = "per_expert"  # one cuBLASLt scaled_mm per expert with tokens, from Python (fp8/gemm.py)


# The experts' data gradients (dY W_e, from W_e^T's blocks) run on the Triton kernel on every GPU: in
# the H200 sweeps with both kernels (rows in benchmarks/results/grouped_gemm.jsonl) it won fc1's data
# gradient in all nine at 32 experts (947-1004 TFLOP/s; the CUDA kernel's best 910-919) and eight at
# 8, and fc2's in six at 32 experts and five at 8 (the CUDA kernel 0-5% ahead where it won).
DATA_GRADIENT_BACKEND = GemmBackend.TRITON


@dataclass(frozen=True)
class ExpertsCall:
    """What one forward needs besides tensors."""

    segments: TokenSegments
    scale_rule: str  # MXFP4 rule of the saved activations (the dispatch's own rule)
    glu_offset: float
    accumulate_in_main_grad: bool  # Megatron's gradient_accumulation_fusion
    backward_follows: bool = True  # False: a no-grad forward (eval, a checkpointed first pass) saves nothing
    weight_cache: Optional[FP8WeightCache] = None  # the module's FP8 weights for the step; None: per use
    gemms: ExpertGemms = ExpertGemms.GROUPED
    telemetry: Optional[Telemetry] = None  # counts the MXFP4 activations saved for backward
    # With a payload: the SwiGLU and fc2 inputs kept in MXFP4. False inside Megatron's recompute, where
    # nothing inexact is kept in FP4, and under --moe-fp4-storage none: then BF16 SwiGLU input and FP8
    # columns of the fc2 input.
    fp4_activations: bool = True
    # --moe-fp4-recompute-experts: keep only the fc1 input (the payload, else the BF16 tokens); backward
    # runs fc1 and the SwiGLU again and reads what fp4_activations False keeps (docs/design.md §6.6).
    recompute: bool = False


def weight_gradients(params, grad_cols, input_cols, dtype, call: ExpertsCall) -> list:
    """What backward returns for the experts' weights of one linear layer, from the colwise gradient
    and input (None for both: no tokens, a zero gradient). With fused accumulation the wgrad goes
    into main_grad (the grouped kernel adds its fp32 sums unrounded, as Megatron's fused wgrad)."""
    main_grads = fused_main_grads(params, call.accumulate_in_main_grad)
    if main_grads is not None:
        if grad_cols is not None:
            _wgrad(call, grad_cols, input_cols, dtype, main_grads)
        return [added_to_main_grad(param, dtype) for param in params]
    if grad_cols is None:
        return [torch.zeros_like(param) for param in params]
    return [grad.to(param.dtype) for param, grad in zip(params, _wgrad(call, grad_cols, input_cols, dtype, None))]


# The kernels' device-side checks of counts and offsets are off here (check_counts, check_offsets):
# TokenSegments.of checks the counts on the host, where it reads them anyway, and builds the offsets
# from them.
def _wgrad(call: ExpertsCall, grad_cols, input_cols, dtype, accumulate_into):
    if call.gemms is not ExpertGemms.PER_EXPERT:
        return K.grouped_wgrad(grad_cols, input_cols, dtype, accumulate_into=accumulate_into,
                               backend=grouped_backend(call.gemms), check_offsets=False)
    return segment_wgrad(call.segments, grad_cols, input_cols, dtype, accumulate_into)


class FP8ExpertsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: ExpertsCall, tokens, probs, payload_rows, *weights):
        segments = call.segments
        num_experts = len(segments.counts)
        fc1_weights, fc2_weights = weights[:num_experts], weights[num_experts:]
        num_tokens, hidden = tokens.shape
        ffn = fc2_weights[0].shape[1]
        dtype = tokens.dtype

        ctx.from_payload = payload_rows is not None
        ctx.fp4_activations = ctx.from_payload and call.fp4_activations and not call.recompute
        # With the copies backward will read (see _saved_activations); none where it recomputes them.
        keeps = call.backward_follows and not call.recompute
        if not ctx.from_payload and keeps and segments.num_tokens:
            # The FP8 baseline keeps the tokens' columns for fc1's wgrad: rows and columns from one read.
            input_rows, input_cols = _rows_and_columns(call, tokens)
        else:
            input_rows, input_cols = _fc1_input_rows(call, payload_rows if ctx.from_payload else tokens,
                                                     ctx.from_payload, hidden), None
        fc1_out = _fc1(call, input_rows, fc1_weights, dtype)
        del input_rows
        fc2_in = swiglu_quantized(fc1_out, probs, call.glu_offset, dtype, keep_values=keeps and not ctx.fp4_activations,
                                  mxfp4_rule=call.scale_rule if keeps and ctx.fp4_activations else None)
        if call.recompute:
            fc1_out = None  # backward computes it again: not kept through the fc2 GEMM
        output = _linear_forward(call, fc2_in.fp8_rows, _fp8_weights(call, "fc2", fc2_weights, False), dtype)

        if not call.backward_follows:
            return output
        saved = _saved_activations(ctx, call, tokens, payload_rows, input_cols, fc1_out, fc2_in)
        ctx.save_for_backward(*saved, probs, *weights)
        ctx.num_activations = len(saved)
        # Bytes of the MXFP4 activations kept for backward (uint8 rows), for the telemetry.
        ctx.fp4_bytes = sum(t.numel() for t in saved if t.dtype == torch.uint8)
        if call.telemetry is not None:
            call.telemetry.hold(ctx.fp4_bytes)
        ctx.call = call
        ctx.sizes = (hidden, ffn)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        call = ctx.call
        segments = call.segments
        hidden, ffn = ctx.sizes
        tensors = ctx.saved_tensors
        activations, (probs, *weights) = tensors[: ctx.num_activations], tensors[ctx.num_activations:]
        num_experts = len(segments.counts)
        fc1_weights, fc2_weights = weights[:num_experts], weights[num_experts:]
        dtype = grad_output.dtype

        def wgrads(params, grad_cols, input_cols):
            return weight_gradients(params, grad_cols, input_cols, dtype, call)

        if segments.num_tokens == 0:  # a rank that received no tokens this step
            _release_saved_fp4(ctx)
            grad_input = grad_output.new_zeros(0, hidden)
            return (None, grad_input, torch.zeros_like(probs), None, *wgrads(weights, None, None))
        grad_output = grad_output.contiguous()
        counts = segments.counts_device

        def mxfp4(rows, width):
            return MXFP4Tensor(rows, width, call.scale_rule)

        # fc2: wgrad and dgrad.
        saved_input, saved_acts = (activations[:1], activations[1:]) if ctx.from_payload or call.recompute else (
            activations[:3], activations[3:])
        if call.recompute:
            # The same bits as forward's.
            fc1_out = _fc1(call, _fc1_input_rows(call, saved_input[0], ctx.from_payload, hidden), fc1_weights, dtype)
            fc2_in = swiglu_quantized(fc1_out, probs, call.glu_offset, dtype, keep_values=True, mxfp4_rule=None)
            fc2_in_cols = K.quantize_fp8_cols(fc2_in.values, counts, check_counts=False)
            del fc2_in
        elif ctx.fp4_activations:
            # Dequantized first: a SwiGLU backward decoding MXFP4 itself ran slower (0.36 against 0.31 ms
            # for fc1_out 32768 x 4096 on an H200, bench_kernels' rows).
            fc1_out = K.dequantize_mxfp4(mxfp4(saved_acts[0], 2 * ffn))
            fc2_in_cols = K.mxfp4_to_fp8_cols(mxfp4(saved_acts[1], ffn), counts, check_counts=False)
        else:
            fc1_out, fc2_in_cols = saved_acts[0], FP8BlockTensor.from_colwise_parts(saved_acts[1:])
        # Each layer's wgrad before its dgrad: the columns are freed before the dgrad's output exists.
        grad_rows, grad_cols = _rows_and_columns(call, grad_output)
        grad_fc2 = wgrads(fc2_weights, grad_cols, fc2_in_cols)
        del grad_cols, fc2_in_cols
        grad_fc2_in = _data_gradient(call, "fc2", grad_rows, fc2_weights, dtype)
        del grad_rows
        grad_fc1_out, grad_probs = swiglu_with_probs_backward(fc1_out, probs, grad_fc2_in, call.glu_offset)
        del fc1_out, grad_fc2_in
        grad_rows, grad_cols = _rows_and_columns(call, grad_fc1_out)
        del grad_fc1_out  # only its FP8 encodings are read from here on

        # fc1: wgrad and dgrad (from the payload, its columns are built only now, after fc2's are freed).
        if ctx.from_payload:
            input_cols = K.mxfp4_to_fp8_cols(mxfp4(saved_input[0], hidden), counts, check_counts=False)
        elif call.recompute:  # the BF16 tokens
            input_cols = K.quantize_fp8_cols(saved_input[0], counts, check_counts=False)
        else:
            input_cols = FP8BlockTensor.from_colwise_parts(saved_input)
        grad_fc1 = wgrads(fc1_weights, grad_cols, input_cols)
        del grad_cols, input_cols
        grad_input = _data_gradient(call, "fc1", grad_rows, fc1_weights, dtype)
        del grad_rows
        _release_saved_fp4(ctx)
        return (None, grad_input, grad_probs, None, *grad_fc1, *grad_fc2)


def _fc1_input_rows(call: ExpertsCall, fc1_input, from_payload: bool, hidden: int) -> FP8BlockTensor:
    """fc1's input as FP8 1x128 rows: from MXFP4 payload rows (the exact FP4 -> FP8 conversion) or
    from BF16 tokens (quantized)."""
    if from_payload:
        return K.mxfp4_to_fp8_rows(MXFP4Tensor(fc1_input, hidden, call.scale_rule))
    return K.quantize_fp8_rows(fc1_input)


def _fc1(call: ExpertsCall, input_rows: FP8BlockTensor, fc1_weights, dtype) -> torch.Tensor:
    """fc1's output from its input in FP8 rows; the SwiGLU (times the probs; row-wise, all experts at
    once) follows it in forward, and in backward again under call.recompute."""
    return _linear_forward(call, input_rows, _fp8_weights(call, "fc1", fc1_weights, False), dtype)


def _saved_activations(ctx, call: ExpertsCall, tokens, payload_rows, input_cols: Optional[FP8BlockTensor], fc1_out,
                       fc2_in: SwiGLUOutputs) -> tuple:
    """What backward reads, as save_for_backward takes it: the fc1 input (the payload, exact; else
    its FP8 columns, input_cols), then the SwiGLU and fc2 inputs (MXFP4 rows, written by the SwiGLU; else BF16 and
    FP8 columns, as Transformer Engine's FP8 layers keep them). Under call.recompute only the fc1 input
    (the payload, else the BF16 tokens). Nothing for a rank without tokens."""
    if not call.segments.num_tokens:
        return ()
    if call.recompute:
        return (payload_rows,) if ctx.from_payload else (tokens,)
    counts = call.segments.counts_device

    def columns(x):
        return K.quantize_fp8_cols(x, counts, check_counts=False).colwise_parts()

    fc1_input = (payload_rows,) if ctx.from_payload else input_cols.colwise_parts()
    if ctx.fp4_activations:
        return (*fc1_input, fc2_in.fc1_out_mxfp4.rows, fc2_in.fc2_in_mxfp4.rows)
    return (*fc1_input, fc1_out, *columns(fc2_in.values))


def _release_saved_fp4(ctx) -> None:
    """Tell the telemetry that the MXFP4 activations forward counted have been used."""
    if ctx.call.telemetry is not None:
        ctx.call.telemetry.release(ctx.fp4_bytes)


def _fp8_weights(call: ExpertsCall, name: str, weights, transpose: bool) -> FP8StackedWeights:
    return fp8_weights(call.weight_cache, name, weights, transpose)


def _linear_forward(call: ExpertsCall, rows, weights: FP8StackedWeights, dtype,
                    data_gradient: bool = False) -> torch.Tensor:
    """Y = X W_e^T for every expert segment, in FP8 (X in 1x128 rows, W_e in 128x128 blocks); a data
    gradient when X is the output gradient and W_e^T the weights."""
    if call.gemms is ExpertGemms.PER_EXPERT:
        return segment_products(call.segments, rows, weights, dtype)
    return K.grouped_gemm_by_weight(rows, weights, call.segments.row_offsets_device, dtype,
                                    backend=grouped_backend(call.gemms, data_gradient), check_offsets=False)


def grouped_backend(gemms: ExpertGemms, data_gradient: bool = False) -> Optional[GemmBackend]:
    """The backend of a grouped GEMM under `gemms` (at its default tiles): GROUPED leaves the forward
    GEMMs and weight gradients to the kernels' default (None: the CUDA kernels on SM90) and runs data
    gradients on DATA_GRADIENT_BACKEND; GROUPED_TRITON runs all on the Triton kernels."""
    if gemms is ExpertGemms.GROUPED_TRITON:
        return GemmBackend.TRITON
    return DATA_GRADIENT_BACKEND if data_gradient else None


def _rows_and_columns(call: ExpertsCall, x: torch.Tensor) -> tuple:
    """x [tokens, features] in FP8 both ways a GEMM pair reads it, from one read of x in memory: 1x128
    rows (an output gradient's data-gradient GEMM, the baseline's fc1) and 1x128 blocks along each
    segment's tokens (a weight gradient)."""
    return K.quantize_fp8_rows_and_cols(x, call.segments.counts_device, check_counts=False)


def _data_gradient(call: ExpertsCall, name: str, grad_rows: FP8BlockTensor, weights, dtype) -> torch.Tensor:
    """dX of Y = X W_e^T for every expert segment, in FP8: the gradient's 1x128 rows times W_e^T in
    128x128 blocks (W^T is made from the cached W for this GEMM and freed after it)."""
    transposed = _fp8_weights(call, name, weights, True)
    return _linear_forward(call, grad_rows, transposed, dtype, data_gradient=True)
