"""Megatron-Core's flex token dispatcher (DeepEP backend) with the dispatch sent in MXFP4.

The steps are those of MoEFlexTokenDispatcher with _DeepepManager (megatron-core 0.18-0.19): the
routing map and probs over the TPxEP group, top-k to (indices, probs), DeepEP's dispatch (here
deepep.dispatch_mxfp4: each token quantized once and sent once per rank that holds one of its
experts), on the receiving rank the rows permuted by local expert, and back: unpermute, DeepEP's
BF16 combine with the dispatch's handle, the original shape, the shared experts. What Megatron keeps
on its manager between those steps (indices, probs, handle, permutation) travels here in values
(`SparseRoute`, `FlexDispatch`, `FlexCombine`; dispatch/contract.py). The experts get the
received payload sorted like their tokens (FP8 experts compute from it). A recompute served by
the cache (--moe-fp4-cache) sends only its probs (deepep.replay_mxfp4).
"""

from dataclasses import dataclass
from typing import List, Optional

import torch
from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization, permute, unpermute
from megatron.core.transformer.moe.token_dispatcher import (MoEFlexTokenDispatcher, MoETokenDispatcher,
                                                            _DeepepManager)

from ..kernels import quantize_mxfp4
from ..options import FP4Options, ModelSettings, Route, validate
from ..tensors import MXFP4Tensor
from .cache import CachedDispatch, DispatchCacheError
from .contract import ExpertsInput, ReceivedTokens
from .deepep import dispatch_mxfp4, replay_mxfp4, require_covered_deep_ep


@dataclass(frozen=True)
class SparseRoute:
    """Each token's experts over the TPxEP group (-1: none) and their float32 probs, [T, K]; the
    layer input's shape. Handed from dispatch_preprocess to dispatch in the probs' place."""

    indices: torch.Tensor
    probs: torch.Tensor
    hidden_shape: torch.Size


@dataclass(frozen=True)
class FlexDispatch:
    """One DeepEP dispatch: its handle, the received rows' expert indices relative to this rank
    (-1 elsewhere), tokens per local expert (host), the layer input's shape, and the sent route's
    indices (what a recompute served by the cache must route the same)."""

    deepep_handle: object
    indices: torch.Tensor
    tokens_per_expert: torch.Tensor
    hidden_shape: torch.Size
    route_indices: torch.Tensor


@dataclass(frozen=True)
class FlexCombine:
    """What the combine of one pass needs: the permute's mapping and map, the received rows' shape,
    the dispatch's handle, the layer input's shape."""

    deepep_handle: object
    reversed_mapping: torch.Tensor
    routing_map: torch.Tensor
    pad_offsets: Optional[torch.Tensor]  # Transformer Engine's padded fused permute, else None
    restore_shape: torch.Size
    hidden_shape: torch.Size


def _in_cached_order(route: SparseRoute, cached_indices: torch.Tensor) -> torch.Tensor:
    """The recompute's probs [T, K] in the columns of the cached first pass's indices (the same experts
    per row, checked by _check_replay, possibly in another order), which the received indices follow."""
    column = (cached_indices.unsqueeze(2) == route.indices.unsqueeze(1)).int().argmax(dim=2)
    return route.probs.gather(1, column)


class FP4FlexTokenDispatcher(MoETokenDispatcher):
    def __init__(self, num_local_experts: int, local_expert_indices: List[int], config, pg_collection=None,
                 options: Optional[FP4Options] = None, route: Route = Route.PLUGIN) -> None:
        self.options = options if options is not None else FP4Options(dispatch=True)
        validate(self.options, ModelSettings.from_config(config), None, route)
        super().__init__(config=config, pg_collection=pg_collection)
        self.num_local_experts = num_local_experts
        self.local_expert_indices = local_expert_indices
        self.group_experts = self.tp_size * config.num_moe_experts
        self.group_topk = self.tp_size * config.moe_router_topk
        require_covered_deep_ep()

    def quantizes_before_permute(self) -> bool:
        """No: the flex dispatch sends each token once per rank and permutes on the receiving side."""
        return False

    def permute_quantized(self, hidden_states, routing_map, probs, quantize: bool):
        raise NotImplementedError("the flex dispatcher permutes after the dispatch (quantizes_before_permute is False)")

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        """(tokens [T, H], SparseRoute): the routing over the TPxEP group as Megatron's flex dispatcher
        builds it, top-k indices with dropped tokens masked -1, probs in float32 (DeepEP's)."""
        hidden_shape = hidden_states.shape
        tokens = hidden_states.view(-1, hidden_shape[-1])
        routing_map, probs = MoEFlexTokenDispatcher._initialize_metadata(self, routing_map, probs)
        num_tokens = routing_map.shape[0]
        probs = probs.reshape(num_tokens, self.group_experts)
        top_probs, indices = torch.topk(probs, self.group_topk, dim=-1)
        if self.config.moe_expert_capacity_factor is not None:
            indices = indices.masked_fill(top_probs == 0, -1)
        return tokens, SparseRoute(indices, top_probs.float(), hidden_shape)

    def dispatch_fp4(self, tokens, route: SparseRoute, dequantize: bool, replay: Optional[CachedDispatch] = None,
                     wire: Optional[MXFP4Tensor] = None):
        """(ReceivedTokens, received probs [R, K]). The tokens are quantized here (once per token); with
        `replay` (a recompute whose first pass the cache kept) only the probs are sent."""
        if wire is not None:
            raise NotImplementedError("the flex dispatcher quantizes in its dispatch, not before a permute")
        if self.shared_experts is not None:
            self.shared_experts.wait_current_stream()
        if replay is None:
            payload = quantize_mxfp4(tokens, self.options.scale_rule)
            received, probs, received_payload, indices, counts, handle = dispatch_mxfp4(
                tokens, payload, route.indices, route.probs, self.group_experts, self.tp_ep_group, dequantize)
            dispatch = FlexDispatch(handle, indices, counts, route.hidden_shape, route.indices)
        else:
            dispatch, received_payload = self._check_replay(replay, tokens, route), replay.payload
            received, probs = replay_mxfp4(tokens, _in_cached_order(route, dispatch.route_indices), received_payload,
                                           dispatch.indices, dispatch.deepep_handle, self.tp_ep_group, dequantize)
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(tokens, wait_current_stream=False)
            self.shared_experts.linear_fc1_forward_and_act(received)
        return ReceivedTokens(received, received_payload, dispatch), probs

    @staticmethod
    def _check_replay(replay: CachedDispatch, tokens, route: SparseRoute) -> FlexDispatch:
        """The cached dispatch, where the recompute routes as its first pass did: its width and shape
        checked on the host, its expert indices on the device (no host sync; a mismatch stops the
        process at the next synchronization)."""
        cached: FlexDispatch = replay.handle
        if replay.payload.hidden != tokens.shape[1] or cached.route_indices.shape != route.indices.shape:
            raise DispatchCacheError(
                f"the cached dispatch does not match the recompute (hidden {replay.payload.hidden} vs "
                f"{tokens.shape[1]}, route {tuple(cached.route_indices.shape)} vs {tuple(route.indices.shape)}): "
                "routing changed between the passes")
        # The same experts per token; their order within a row may differ (top-k of probs one unit apart).
        sorted_cached, sorted_now = cached.route_indices.sort(dim=1).values, route.indices.sort(dim=1).values
        torch._assert_async((sorted_cached == sorted_now).all(),
                            "megatron_fp4: the recompute routed differently from the cached first pass")
        return cached

    def experts_input(self, received: ReceivedTokens, probs, sort_payload: bool) -> ExpertsInput:
        """The received rows permuted by local expert (Megatron's permute, as its flex dispatcher
        calls it), the payload rows in the same order where asked, and the combine's handle."""
        dispatch: FlexDispatch = received.handle
        # Megatron's own conversion (it reads only num_local_experts from its manager).
        routing_map, dense_probs = _DeepepManager._indices_to_multihot(self, dispatch.indices, probs)
        tokens_per_expert = dispatch.tokens_per_expert
        num_out = int(tokens_per_expert.sum())
        tokens, permuted_probs, mapping, pad_offsets, tokens_per_expert = permute(
            received.tokens, routing_map, probs=dense_probs, num_out_tokens=num_out,
            fused=self.config.moe_permute_fusion, tokens_per_expert=tokens_per_expert,
            align_size=get_align_size_for_quantization(self.config))
        payload = None
        if sort_payload and pad_offsets is not None:
            raise NotImplementedError("the FP4 flex dispatcher does not sort the payload like Transformer Engine's "
                                      "padded fused permute: drop --moe-permute-fusion with this precision recipe")
        if sort_payload:
            rows = mapping
            if self.config.moe_permute_fusion:  # the fused permute's mapping is not a row list: take the plain one
                _, _, rows, _, _ = permute(received.payload.rows[:, :0], routing_map, num_out_tokens=num_out)
            payload = received.payload.select_tokens(rows)
        if self.config.moe_router_dtype == "fp64":
            permuted_probs = permuted_probs.to(torch.float64)
        handle = FlexCombine(dispatch.deepep_handle, mapping, routing_map, pad_offsets, received.tokens.shape,
                             dispatch.hidden_shape)
        return ExpertsInput(tokens, tokens_per_expert, permuted_probs, payload, handle)

    def combine_preprocess_fp4(self, output, handle: FlexCombine):
        """Each received token's local experts' rows added (Megatron's unpermute)."""
        return unpermute(output, handle.reversed_mapping, restore_shape=handle.restore_shape,
                         routing_map=handle.routing_map, fused=self.config.moe_permute_fusion,
                         pad_offsets=handle.pad_offsets)

    def token_combine_fp4(self, output, handle: FlexCombine):
        """DeepEP's BF16 combine with the dispatch's handle (Megatron's fused_combine)."""
        from megatron.core.transformer.moe.fused_a2a import fused_combine

        if self.shared_experts is not None:
            self.shared_experts.wait_current_stream()
        combined, _ = fused_combine(output, self.tp_ep_group, handle.deepep_handle, async_finish=True,
                                    allocate_on_comm_stream=True)
        return combined

    def combine_postprocess_fp4(self, output, handle: FlexCombine):
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward(output)
            self.shared_experts.post_forward_comm()
            output += self.shared_experts.get_output()
        return output.view(handle.hidden_shape)


__all__ = ["FP4FlexTokenDispatcher", "FlexCombine", "FlexDispatch", "SparseRoute"]
