"""Megatron-Core's all-to-all token dispatcher with the token all-to-all sent in MXFP4.

`dispatch_fp4` keeps the parent's launch order (megatron-core 0.18-0.19): wait for the shared
experts' stream, synchronize the splits at the parent's own sync point, tokens all-to-all,
shared-expert fc1, probs all-to-all. It returns what this rank received as a value
(`ReceivedTokens`): the experts' BF16 input and the MXFP4 payload it is the exact dequantization
of. `token_dispatch`, Megatron's own entry point (the patch route), hands Megatron's experts the
BF16 part. Without --moe-permute-fusion the permute's gradient and the unpermute add rows without
atomics (permute.py), and the plugin layer permutes MXFP4 rows instead of BF16 tokens
(`permute_quantized`: each token quantized once, not once per chosen expert; the same bytes, as
quantization is per row). Routing, probs, the combine's all-to-all and every host sync are the parent's.
"""

from typing import List, Optional

import torch
from megatron.core.tensor_parallel import all_to_all
from megatron.core.transformer.moe.moe_utils import (
    get_align_size_for_quantization, pad_routing_map, permute, sort_chunks_by_idxs,
)
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from ..kernels import quantize_mxfp4
from ..options import FP4Options, ModelSettings, Route, validate
from ..tensors import MXFP4Tensor
from .all_to_all import fp4_dispatch_all_to_all
from .alltoall_combine import AlltoAllCombine, AlltoAllSplits, restore_tokens, send_back, unsort_by_source
from .cache import CachedDispatch
from .contract import ExpertsInput, QuantizedPermute, ReceivedTokens
from .permute import LeanPermute, permuted_stand_in
from .replay import replay_tokens


def _host_splits(splits) -> List[int]:
    """The parent keeps its splits as numpy arrays after its device-to-host copy."""
    return [int(n) for n in splits.tolist()]


class FP4AlltoAllTokenDispatcher(LeanPermute, MoEAlltoAllTokenDispatcher):
    def __init__(self, num_local_experts: int, local_expert_indices: List[int], config, pg_collection=None,
                 options: Optional[FP4Options] = None, route: Route = Route.PLUGIN) -> None:
        self.options = options if options is not None else FP4Options(dispatch=True)
        validate(self.options, ModelSettings.from_config(config), None, route)
        super().__init__(num_local_experts, local_expert_indices, config=config, pg_collection=pg_collection)

    def _splits(self, num_tokens: int):
        """(output_splits, input_splits) as host lists. The parent leaves them None with a single
        EP rank and, with drop-and-pad, sends equal shares."""
        if self.input_splits is None:
            share = num_tokens // self.ep_size
            return [share] * self.ep_size, [share] * self.ep_size
        return _host_splits(self.output_splits), _host_splits(self.input_splits)

    def quantizes_before_permute(self) -> bool:
        """Whether permute_quantized may replace dispatch_preprocess: not with --moe-permute-fusion
        (Transformer Engine's fused permute of BF16 tokens) nor --moe-latent-size (MoELayer projects
        the tokens between the router and the permute)."""
        return self._atomic_free_sums() and not self.config.moe_latent_size

    def permute_quantized(self, hidden_states, routing_map, probs, quantize: bool):
        """dispatch_preprocess with the permute done on MXFP4 rows: the tokens are quantized once
        (T rows, not top-k x T) and their wire rows gathered, 17/64 of the BF16 gather's bytes.
        quantize=False (a replayed dispatch) skips the quantization. Returns (QuantizedPermute,
        the permuted probs). Call only where quantizes_before_permute()."""
        # The parent's metadata steps and its host sync point, in its order (megatron-core 0.18-0.19;
        # tests/integration/test_lean_permute.py compares the state with the parent's).
        assert probs.dim() == 2 and routing_map.dim() == 2 and routing_map.dtype == torch.bool, \
            "probs and routing_map must be 2-D [tokens, experts], the map boolean (as the parent asserts)"
        self.hidden_shape = hidden_states.shape
        self.probs = probs
        self.routing_map = routing_map
        tokens = hidden_states.view(-1, hidden_states.shape[-1])
        if self.config.moe_router_padding_for_quantization:
            self.routing_map = pad_routing_map(self.routing_map, get_align_size_for_quantization(self.config))
        self.tokens_per_expert = self.preprocess(self.routing_map)
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states)
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_permutation_1", self.tokens_per_expert)
        self.hidden_shape_before_permute = tokens.shape
        # Megatron's permute for the indices and the probs; the tokens it gathers have no columns.
        _, permuted_probs, self.reversed_local_input_permutation_mapping, _, _ = permute(
            tokens[:, :0], self.routing_map, probs=probs, num_out_tokens=self.num_out_tokens, fused=False,
            drop_and_pad=self.drop_and_pad,
        )
        rows = self._token_rows()
        wire = quantize_mxfp4(tokens, self.options.scale_rule).select_tokens(rows.indices) if quantize else None
        return QuantizedPermute(permuted_stand_in(tokens, rows), wire, tokens), permuted_probs

    def token_dispatch(self, permutated_local_input_tokens, permuted_probs):
        """Megatron's entry point: the received tokens in BF16 for Megatron's experts."""
        received, global_probs = self.dispatch_fp4(permutated_local_input_tokens, permuted_probs, dequantize=True)
        return received.tokens, global_probs

    def dispatch_fp4(self, permutated_local_input_tokens, permuted_probs, dequantize: bool,
                     replay: Optional[CachedDispatch] = None, wire: Optional[MXFP4Tensor] = None):
        """(ReceivedTokens, the received probs). With `wire` (QuantizedPermute.wire) those rows are
        sent and the tokens only carry the gradient path. With `replay` (a recompute whose first pass was
        cached), the tokens come from it and only the gradient path crosses the all-to-all; the
        probs are sent again (4 bytes per row): Megatron's router sorts its top-k only with grad on,
        so the first pass and the recompute can differ by one BF16 unit in the probs, and the
        recompute's own probs are what an uncached run uses."""
        if self.shared_experts is not None:
            self.shared_experts.wait_current_stream()
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_ep_alltoall", self.tokens_per_expert)
        output_splits, input_splits = self._splits(permutated_local_input_tokens.shape[0])
        options = self.options
        splits = AlltoAllSplits(tuple(output_splits), tuple(input_splits))
        if replay is None:
            tokens, payload = fp4_dispatch_all_to_all(
                permutated_local_input_tokens, output_splits, input_splits, group=self.ep_group,
                scale_rule=options.scale_rule, grad_format=options.dispatch_grad, dequantize=dequantize, quantized=wire,
            )
        else:
            replay.check(splits, permutated_local_input_tokens.shape[1])
            payload = replay.payload
            tokens = replay_tokens(permutated_local_input_tokens, payload, output_splits, input_splits,
                                   self.ep_group, options.dispatch_grad, dequantize=dequantize)
        if self.shared_experts is not None:
            self.shared_experts.linear_fc1_forward_and_act(tokens)
        global_probs = all_to_all(
            self.ep_group, permuted_probs, self.output_splits, self.input_splits, use_nccl_stream=self.use_nccl_stream
        )
        return ReceivedTokens(tokens, payload, splits), global_probs

    def experts_input(self, received: ReceivedTokens, probs, sort_payload: bool) -> ExpertsInput:
        """The parent's dispatch_postprocess (its sort by local expert, behind its host syncs), the
        payload sorted the same way where asked (sort_payload), and the combine's handle, captured
        now that the parent's counts are on the host."""
        tokens, tokens_per_expert, probs = self.dispatch_postprocess(received.tokens, probs)
        payload = self.sort_like_experts(received.payload) if sort_payload else None
        handle = AlltoAllCombine(
            hidden_shape=self.hidden_shape, restore_shape=self.hidden_shape_before_permute,
            reversed_mapping=self.reversed_local_input_permutation_mapping, routing_map=self.routing_map,
            token_rows=self._token_rows() if self._atomic_free_sums() else None,
            output_splits=self.output_splits, input_splits=self.input_splits, output_splits_tp=self.output_splits_tp,
            num_global_tokens_per_local_expert=getattr(self, "num_global_tokens_per_local_expert", None),
            capacity=self.capacity, probs_dtype=self.probs.dtype)
        return ExpertsInput(tokens, tokens_per_expert, probs, payload, handle)

    def combine_preprocess_fp4(self, output, handle: AlltoAllCombine):
        return unsort_by_source(self, output, handle)

    def token_combine_fp4(self, output, handle: AlltoAllCombine):
        return send_back(self, output, handle)

    def combine_postprocess_fp4(self, output, handle: AlltoAllCombine):
        return restore_tokens(self, output, handle)

    def sort_like_experts(self, payload: MXFP4Tensor) -> MXFP4Tensor:
        """The payload rows in the experts' input order; call right after dispatch_postprocess,
        which sorted the tokens by local expert (behind its host sync) with the same indices."""
        if self.num_local_experts == 1 or self.one_source_rank():
            return payload
        rows, _ = sort_chunks_by_idxs(payload.rows, self.num_global_tokens_per_local_expert.ravel(),
                                      self.sort_input_by_local_experts, fused=False)
        return MXFP4Tensor(rows, payload.hidden, payload.scale_rule)


__all__ = ["FP4AlltoAllTokenDispatcher"]
