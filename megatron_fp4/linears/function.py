"""Y = X W^T as FP8 block-scaled GEMMs, forward and backward, with the input kept for the weight
gradient in FP8 or in MXFP4 (docs/design.md §2, §6.3).

Forward: X in 1x128 rows times W in 128x128 blocks. Saved for backward: only X, quantized along
tokens, either as the FP8 1x128 columns the weight-gradient GEMM reads (FP8 storage: one byte per
element plus an fp32 scale per 128 tokens) or as MXFP4 rows (H/2 + H/32 bytes per token) that
backward turns into those columns by the exact FP4 -> FP8 conversion; a layernorm output that
Megatron recomputes before backward, and an input that its producer keeps for backward itself (the
fused attention's output), are kept as the tensor itself (nothing stored) and quantized to those
columns in backward. Backward: dX = dY W in FP8
(dY in 1x128 rows, W^T in 128x128 blocks); dW = dY^T X with both operands 1x128 along tokens.

The GEMMs are the cuBLASLt path the experts also have (fp8/gemm.py) over one segment that holds
every token, so they run where a dense scaled_mm runs. A weight whose output features are not a multiple
of 128 (MLA's kv down-projection: 512 + 64) is quantized with zero rows up to the next multiple:
the extra output columns are computed and dropped, and the gradient gets zero columns there.
"""

import enum
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .. import kernels as K
from ..formats import FP8_BLOCK
from ..fp8 import FP8WeightCache, TokenSegments, fp8_weights, segment_products, segment_wgrad
from ..main_grad import added_to_main_grad, fused_main_grads
from ..options import GradFormat
from ..tensors import FP8BlockTensor, MXFP4Tensor


class SavedInput(enum.Enum):
    """How a linear layer keeps its input for the weight gradient."""

    FP8 = "fp8"  # FP8 1x128 columns, built in forward (the FP8 baseline, Transformer Engine's choice)
    MXFP4 = "mxfp4"  # MXFP4 rows (the paper's recipe), converted exactly to FP8 columns in backward
    # The input tensor itself, quantized to FP8 columns in backward, where keeping it stores nothing:
    # a layernorm's output that Megatron discards after forward and recomputes before backward
    # (--recompute-modules layernorm), as Megatron has Transformer Engine's FP8 layers do there, and
    # an input its producer saves for its own backward anyway (the fused attention's output, read by
    # the output projection: module.saved_by_its_producer).
    ORIGINAL = "original"


@dataclass(frozen=True)
class LinearCall:
    """What one forward needs besides the input and the weight."""

    saved: SavedInput
    scale_rule: str  # MXFP4 rule of a saved MXFP4 input
    accumulate_in_main_grad: bool  # Megatron's gradient_accumulation_fusion
    backward_follows: bool  # False: a no-grad forward saves nothing
    weight_cache: Optional[FP8WeightCache]  # the module's FP8 weights for the step; None: per use
    grad_format: GradFormat = GradFormat.FP8  # BF16: both backward GEMMs in BF16 (--moe-fp4-linears-grad)


def padded_features(n: int) -> int:
    return -(-n // FP8_BLOCK) * FP8_BLOCK


def quantize_weight_padded(weights, transpose: bool):
    """The 128x128-block FP8 copy of one weight [N, K], with zero rows up to a multiple of 128."""
    (weight,) = weights
    pad = padded_features(weight.shape[0]) - weight.shape[0]
    if pad:
        weight = F.pad(weight, (0, 0, 0, pad))
    return K.quantize_fp8_weights_stacked([weight], transpose)


def _fp8_weight(call: LinearCall, weight: torch.Tensor, transpose: bool):
    return fp8_weights(call.weight_cache, "weight", [weight], transpose, quantize_weight_padded)


def _padded_columns(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[1] == width else F.pad(x, (0, width - x.shape[1]))


class FP8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: LinearCall, x: torch.Tensor, weight: torch.Tensor):
        out_features, in_features = weight.shape
        if x.shape[-1] != in_features:
            raise ValueError(f"FP8 linear: input {tuple(x.shape)} does not match the weight {tuple(weight.shape)}")
        leading = x.shape[:-1]
        x2d = x.reshape(-1, in_features).contiguous()
        segments = TokenSegments.of([x2d.shape[0]], x.device)
        output = segment_products(segments, K.quantize_fp8_rows(x2d), _fp8_weight(call, weight, False), x.dtype)
        if output.shape[1] != out_features:
            output = output[:, :out_features].contiguous()
        if call.backward_follows:
            if call.saved is SavedInput.MXFP4:
                saved = (K.quantize_mxfp4(x2d, call.scale_rule).rows,)
            elif call.saved is SavedInput.ORIGINAL:
                saved = (x,)  # the caller's tensor, whose storage Megatron refills before backward
            else:
                saved = K.quantize_fp8_cols(x2d, segments.counts_device, check_counts=False).colwise_parts()
            ctx.save_for_backward(weight, *saved)
            ctx.call, ctx.segments, ctx.in_features = call, segments, in_features
        return output.view(*leading, out_features)

    @staticmethod
    def backward(ctx, grad_output):
        call, segments = ctx.call, ctx.segments
        if call.grad_format is GradFormat.BF16:
            return (None,) + _bf16_backward(ctx, call, grad_output)
        weight = ctx.saved_tensors[0]
        out_features = weight.shape[0]
        dtype = grad_output.dtype
        grad2d = _padded_columns(grad_output.reshape(-1, out_features), padded_features(out_features)).contiguous()

        grad_input = grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_input = segment_products(segments, K.quantize_fp8_rows(grad2d), _fp8_weight(call, weight, True),
                                             dtype).view(*grad_output.shape[:-1], ctx.in_features)
        if ctx.needs_input_grad[2]:
            grad_weight = _weight_gradient(call, segments, weight, *_wgrad_operands(ctx, call, segments, grad2d), dtype)
        return None, grad_input, grad_weight


def _bf16_backward(ctx, call: LinearCall, grad_output):
    """(dX, dW) as BF16 GEMMs of the unquantized gradient, against the BF16 weight and the saved input
    dequantized to BF16 (its FP8 or MXFP4 values, exactly)."""
    weight = ctx.saved_tensors[0]
    grad2d = grad_output.reshape(-1, weight.shape[0])
    grad_input = grad_weight = None
    if ctx.needs_input_grad[1]:
        grad_input = (grad2d @ weight.to(grad2d.dtype)).view(*grad_output.shape[:-1], ctx.in_features)
    if ctx.needs_input_grad[2]:
        # A BF16 product, added to an fp32 main_grad as Megatron's BF16 linears add theirs.
        product = grad2d.t() @ _saved_input_bf16(ctx, call, grad2d.shape[0], grad2d.dtype)
        grad_weight = _returned_or_accumulated(call, weight, product, grad2d.dtype)
    return grad_input, grad_weight


def _saved_input_bf16(ctx, call: LinearCall, tokens: int, dtype) -> torch.Tensor:
    """The saved input as [tokens, in_features] in `dtype`, with the values it was saved with (the
    dequantizers' BF16 holds FP8 and FP4 values exactly)."""
    saved = ctx.saved_tensors[1:]
    if call.saved is SavedInput.MXFP4:
        values = K.dequantize_mxfp4(MXFP4Tensor(saved[0], ctx.in_features, call.scale_rule))
    elif call.saved is SavedInput.ORIGINAL:
        values = saved[0].reshape(tokens, ctx.in_features)
    else:
        values = K.dequantize_fp8(FP8BlockTensor.from_colwise_parts(saved))[:, :tokens].t()  # from [K, padded T]
    return values.to(dtype)


def _wgrad_operands(ctx, call: LinearCall, segments, grad2d):
    """(gradient, input) as the weight gradient's operands: both FP8 1x128 columns along tokens."""
    saved = ctx.saved_tensors[1:]
    grad_cols = K.quantize_fp8_cols(grad2d, segments.counts_device, check_counts=False)
    if call.saved is SavedInput.MXFP4:
        input_cols = K.mxfp4_to_fp8_cols(MXFP4Tensor(saved[0], ctx.in_features, call.scale_rule),
                                         segments.counts_device, check_counts=False)
    elif call.saved is SavedInput.ORIGINAL:
        input_cols = K.quantize_fp8_cols(saved[0].reshape(-1, ctx.in_features).contiguous(), segments.counts_device,
                                         check_counts=False)
    else:
        input_cols = FP8BlockTensor.from_colwise_parts(saved)
    return grad_cols, input_cols


def _weight_gradient(call: LinearCall, segments, weight, grad_cols, input_cols, dtype):
    """dW [N, K]; with Megatron's fused accumulation added into main_grad (a dummy returned)."""
    main_grads = fused_main_grads([weight], call.accumulate_in_main_grad)
    if main_grads is not None and grad_cols.shape[0] == weight.shape[0]:
        segment_wgrad(segments, grad_cols, input_cols, dtype, accumulate_into=main_grads)
        return added_to_main_grad(weight, dtype)
    # Padded output features: the product has extra rows, dropped before the main_grad add.
    product = segment_wgrad(segments, grad_cols, input_cols, dtype)[0, : weight.shape[0]]
    return _returned_or_accumulated(call, weight, product, dtype)


def _returned_or_accumulated(call: LinearCall, weight, grad_weight, dtype):
    """dW returned, or added into main_grad under Megatron's fused accumulation (a dummy returned)."""
    main_grads = fused_main_grads([weight], call.accumulate_in_main_grad)
    if main_grads is None:
        return grad_weight.to(weight.dtype)
    main_grads[0].add_(grad_weight)
    return added_to_main_grad(weight, dtype)
