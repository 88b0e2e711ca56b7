"""MXFP4 through DeepEP's normal-mode dispatch, unmodified: the payload rides its FP8 slot.

DeepEP's `Buffer.dispatch` takes `x` as BF16 [T, H] or as (E4M3 [T, W], FP32 scales [T, S]) and moves
those bytes without reading their values; its combine is BF16 only. An MXFP4 row (formats.py: H/2
bytes of E2M1 codes, then H/32 E8M0 scales) goes in the FP8 slot as the codes viewed as E4M3
[T, H/2] and the scales packed four to a float32 [T, H/128]: H/2 + H/32 bytes per token, 3808 at
H 7168 against 7392 for DeepEP's FP8 and 14336 for BF16. The backward and the combine are DeepEP's
BF16 combine with the dispatch's handle, as in Megatron's own flex dispatcher (fused_a2a.py), whose
buffer and SM setting this shares.

Nothing here is on a GPU in CI: tests run it against a project-written stand-in of DeepEP's Buffer
(tests/support/deep_ep_standin) on two CPU ranks.
"""

import importlib.metadata
from typing import Tuple

import torch

from ..options import UnsupportedConfiguration
from ..tensors import MXFP4Tensor
from .all_to_all import received_tokens

# The DeepEP releases whose normal-mode dispatch and combine were read for this (v1.2.1; its version
# is "1.2.1+<git hash>"). DeepEP's main (2.x) no longer exports what megatron-core 0.18-0.19 import.
COVERED_DEEP_EP = ("1.2",)


def require_covered_deep_ep() -> str:
    """DeepEP's installed version where megatron-core found it and it is one we cover; otherwise
    raise UnsupportedConfiguration in one sentence."""
    from megatron.core.transformer.moe import fused_a2a

    if not fused_a2a.HAVE_DEEP_EP:
        raise UnsupportedConfiguration("--moe-fp4-dispatch with --moe-token-dispatcher-type flex sends through "
                                       "DeepEP, which megatron-core cannot import here: install deep_ep 1.2.")
    try:
        version = importlib.metadata.version("deep_ep")
    except importlib.metadata.PackageNotFoundError:  # a source tree on the path: no installed metadata
        import deep_ep

        version = getattr(deep_ep, "__version__", "unknown")
    if not version.startswith(tuple(v + "." for v in COVERED_DEEP_EP)):
        raise UnsupportedConfiguration(
            f"--moe-fp4-dispatch through DeepEP covers DeepEP {', '.join(COVERED_DEEP_EP)} (its normal-mode "
            f"dispatch carrying bytes in its FP8 slot was read there); found deep_ep {version}.")
    return version


def pack_for_fp8_slot(payload: MXFP4Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 wire rows [T, H/2 + H/32] -> (codes as E4M3 [T, H/2], scales as float32 [T, H/128]), both
    contiguous (DeepEP requires it)."""
    half, hidden = payload.hidden // 2, payload.hidden
    if hidden % 128:
        raise ValueError(f"the FP8 slot packs four E8M0 scales per float32: hidden must be divisible by 128, got {hidden}")
    codes = payload.rows[:, :half].contiguous().view(torch.float8_e4m3fn)
    scales = payload.rows[:, half:].contiguous().view(torch.float32)
    return codes, scales


def unpack_from_fp8_slot(codes: torch.Tensor, scales: torch.Tensor, hidden: int, scale_rule: str) -> MXFP4Tensor:
    """Inverse of pack_for_fp8_slot."""
    if codes.shape[1] * 2 != hidden or scales.shape[1] * 128 != hidden:
        raise ValueError(f"FP8-slot tensors {tuple(codes.shape)} and {tuple(scales.shape)} do not hold hidden {hidden}")
    rows = torch.cat([codes.view(torch.uint8), scales.view(torch.uint8)], dim=1)
    return MXFP4Tensor(rows, hidden, scale_rule)


def _deep_ep_events():
    """A fresh `previous_event` for DeepEP's asynchronous calls (as Megatron's fused_a2a makes them)."""
    from megatron.core.transformer.moe import fused_a2a

    return fused_a2a.EventOverlap(fused_a2a.EventHandle())


def _buffer(group, hidden: int):
    """Megatron's one DeepEP buffer for the process, sized for the widest call: the BF16 combine."""
    from megatron.core.transformer.moe import fused_a2a

    buffer = fused_a2a.get_buffer(group, hidden * 2)
    if getattr(buffer, "low_latency_mode", False):
        raise RuntimeError("--moe-fp4-dispatch through DeepEP serves its normal mode only; the process's DeepEP "
                           "buffer is in low-latency mode.")
    return buffer


class _MXFP4DeepEPDispatch(torch.autograd.Function):
    """Forward: the MXFP4 rows through DeepEP's dispatch. Backward: the received tokens' gradient and
    their probs' gradient back through its BF16 combine with the same handle (straight through the
    quantization, as the all-to-all path)."""

    @staticmethod
    def forward(ctx, tokens, probs, rows, indices, num_experts, group, scale_rule, dequantize):
        hidden = tokens.shape[1]
        buffer = _buffer(group, hidden)
        async_calls = {"async_finish": True, "allocate_on_comm_stream": True}
        # Packed before the layout's event is recorded: DeepEP's stream waits on that event alone,
        # not on the compute stream, so a copy launched after it could still be running when sent.
        sent = pack_for_fp8_slot(MXFP4Tensor(rows, hidden, scale_rule))
        per_rank, per_rdma_rank, per_expert, in_rank, event = buffer.get_dispatch_layout(
            indices, num_experts, previous_event=_deep_ep_events(), **async_calls)
        (codes, scales), recv_indices, recv_probs, counts, handle, after = buffer.dispatch(
            sent, topk_idx=indices, topk_weights=probs,
            num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, previous_event=event, **async_calls)
        after.current_stream_wait()
        received = unpack_from_fp8_slot(codes, scales, hidden, scale_rule)
        ctx.group, ctx.handle, ctx.hidden, ctx.dtype = group, handle, hidden, tokens.dtype
        ctx.mark_non_differentiable(received.rows, recv_indices)
        return (received_tokens(received, tokens.dtype, dequantize), recv_probs, received.rows, recv_indices,
                torch.tensor(counts), handle)

    @staticmethod
    def backward(ctx, grad_tokens, grad_probs, _rows, _indices, _counts, _handle):
        return _combine_back(ctx, grad_tokens, grad_probs) + (None,) * 6


def _combine_back(ctx, grad_tokens, grad_probs):
    """(tokens' gradient, probs' gradient) at the senders: DeepEP's BF16 combine with the dispatch's handle."""
    buffer = _buffer(ctx.group, ctx.hidden)
    grad_x, grad_weights, after = buffer.combine(
        grad_tokens.contiguous(), ctx.handle, topk_weights=grad_probs.float(), previous_event=_deep_ep_events(),
        async_finish=True, allocate_on_comm_stream=True)
    after.current_stream_wait()
    return grad_x.to(ctx.dtype), grad_weights


class _ReplayMXFP4DeepEP(torch.autograd.Function):
    """A recompute's dispatch served by the recompute cache: the tokens are the first pass's payload,
    only this pass's probs cross DeepEP (Megatron's router sorts its top-k only with grad on, so they
    can differ from the first pass's by a unit), as x of a dispatch in DeepEP's cached mode (which
    takes no top-k arguments) with the first pass's handle; backward as an uncached dispatch."""

    @staticmethod
    def forward(ctx, tokens, probs, rows, received_indices, handle, group, scale_rule, dequantize):
        hidden, topk = tokens.shape[1], probs.shape[1]
        # Rows of whole 32 bytes: DeepEP's intranode kernel asserts it (its Python API checks 16).
        sent = probs.new_zeros(probs.shape[0], -(-topk // 8) * 8)
        sent[:, :topk] = probs
        received, _, _, _, _, after = _buffer(group, hidden).dispatch(
            sent, handle=handle, previous_event=_deep_ep_events(), async_finish=True, allocate_on_comm_stream=True)
        after.current_stream_wait()
        # As DeepEP's own dispatch delivers them: zero where the expert is on another rank.
        received_probs = received[:, :topk].masked_fill(received_indices == -1, 0.0)
        ctx.group, ctx.handle, ctx.hidden, ctx.dtype = group, handle, hidden, tokens.dtype
        return received_tokens(MXFP4Tensor(rows, hidden, scale_rule), tokens.dtype, dequantize), received_probs

    @staticmethod
    def backward(ctx, grad_tokens, grad_probs):
        return _combine_back(ctx, grad_tokens, grad_probs) + (None,) * 6


def dispatch_mxfp4(tokens: torch.Tensor, payload: MXFP4Tensor, indices: torch.Tensor, probs: torch.Tensor,
                   num_experts: int, group, dequantize: bool):
    """tokens [T, H] BF16 (their gradient path; with `payload` their MXFP4 rows, which are what is sent);
    indices / probs [T, K]: each token's experts (-1: none) and float32 probs over the group's experts.
    Returns (received tokens [R, H] (their values as in all_to_all.received_tokens), received probs
    [R, K], received payload, received indices [R, K] relative to this rank's experts (-1 elsewhere),
    tokens per local expert (host tensor), DeepEP's handle)."""
    if tokens.dtype != torch.bfloat16:
        raise ValueError(f"DeepEP's combine (the dispatch's backward) is BF16 only: tokens must be bfloat16, "
                         f"got {tokens.dtype}")
    received, recv_probs, rows, recv_indices, counts, handle = _MXFP4DeepEPDispatch.apply(
        tokens, probs, payload.rows, indices, num_experts, group, payload.scale_rule, dequantize)
    return received, recv_probs, MXFP4Tensor(rows, payload.hidden, payload.scale_rule), recv_indices, counts, handle


def replay_mxfp4(tokens: torch.Tensor, probs: torch.Tensor, cached: MXFP4Tensor, received_indices: torch.Tensor,
                 handle, group, dequantize: bool):
    """The recompute of a dispatch_mxfp4 whose first pass was cached: (received tokens, received probs)
    as that dispatch would return them, from the cached payload and received indices and DeepEP's
    handle of the first pass; only `probs` [T, K] is sent."""
    return _ReplayMXFP4DeepEP.apply(tokens, probs, cached.rows, received_indices, handle, group, cached.scale_rule,
                                    dequantize)


__all__ = ["COVERED_DEEP_EP", "dispatch_mxfp4", "replay_mxfp4", "pack_for_fp8_slot", "require_covered_deep_ep", "unpack_from_fp8_slot"]
