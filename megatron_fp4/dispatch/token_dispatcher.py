"""Megatron-Core's all-to-all token dispatcher with the token all-to-all sent in MXFP4.

Only `token_dispatch` changes. It keeps the parent's launch order (megatron-core 0.17-0.19):
wait for the shared experts' stream, synchronize the splits at the parent's own sync point,
tokens all-to-all, shared-expert fc1, probs all-to-all. The token all-to-all becomes
`fp4_dispatch_all_to_all`, with the same splits and group; the experts receive BF16 (exact
dequantization of the MXFP4 payload), so Megatron's SequentialMLP / TEGroupedMLP run unchanged.
FP8 experts (payload_for_experts) take the payload itself: their BF16 input is then a placeholder
that only carries the gradient path, and no dequantization runs.
Routing, probs, the combine and every host sync are the parent's.
"""

from typing import List, Optional

from megatron.core.tensor_parallel import all_to_all
from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

import torch

from ..formats import FP8_BLOCK
from .all_to_all import fp4_dispatch_all_to_all
from .cache import CachedDispatch, DispatchCache, DispatchCacheError
from .options import CACHE_WITH_CAPACITY, FP4DispatchOptions
from ..tensors import MXFP4Tensor
from .replay import replay_tokens


def _host_splits(splits) -> List[int]:
    """The parent keeps its splits as numpy arrays after its device-to-host copy."""
    return [int(n) for n in splits.tolist()]


class FP4AlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher):
    def __init__(self, num_local_experts: int, local_expert_indices: List[int], config,
                 pg_collection=None, options: Optional[FP4DispatchOptions] = None) -> None:
        super().__init__(num_local_experts, local_expert_indices, config=config, pg_collection=pg_collection)
        if self.tp_size > 1:
            # dispatch_postprocess would all-gather the tokens over the expert-TP group in BF16,
            # and FP4-aware experts would lose the payload there.
            raise ValueError(
                f"the FP4 dispatcher does not support expert tensor parallelism (size {self.tp_size}); "
                "use --expert-tensor-parallel-size 1"
            )
        dispatched_width = getattr(config, "moe_latent_size", None) or config.hidden_size
        if dispatched_width % FP8_BLOCK:
            raise ValueError(f"the FP4 dispatcher needs the dispatched width (hidden or MoE latent size) divisible by "
                             f"{FP8_BLOCK}, got {dispatched_width}")
        self.fp4_options = options if options is not None else FP4DispatchOptions()
        if self.fp4_options.cache and config.moe_expert_capacity_factor is not None:
            raise ValueError(CACHE_WITH_CAPACITY)
        # With --moe-fp4-cache: the recompute cache, and the micro-batch the layer is running (set by
        # FP4MoELayer when its forward is checkpointed; None otherwise, and then nothing is cached).
        self.recompute_cache = DispatchCache(f"MoE experts {local_expert_indices[0]}..") if self.fp4_options.cache else None
        self.micro_batch_key = None
        self.layer_names_micro_batches = False  # FP4MoELayer sets it (and hooks the experts); a patched MoELayer does not
        # With saved_input or FP8 experts: the received payload, then the experts' input and its
        # payload rows in the same order, for FP4MoELayer's saved-tensor hooks (see saved_fp4.py)
        # or for the experts themselves (take_expert_input).
        self._received_payload = None
        self.expert_input_payload = None
        # Set by FP4MoELayer when its experts are FP8Experts, which read the payload in every pass.
        self.payload_for_experts = False
        if self.fp4_options.saved_input and (config.moe_permute_fusion or self.drop_and_pad):
            raise ValueError(
                "--moe-fp4-saved-input does not support --moe-permute-fusion or --moe-pad-expert-input-to-capacity "
                "yet: the payload rows must be reordered like the experts' input, by the unfused sort"
            )

    def _splits(self, num_tokens: int):
        """(output_splits, input_splits) as host lists. The parent leaves them None with a single
        EP rank and, with drop-and-pad, sends equal shares."""
        if self.input_splits is None:
            share = num_tokens // self.ep_size
            return [share] * self.ep_size, [share] * self.ep_size
        return _host_splits(self.output_splits), _host_splits(self.input_splits)

    def _cache_role(self) -> str:
        """'record' in a checkpointed layer's first (no-grad) pass, 'replay' in its recompute."""
        if self.recompute_cache is None or self.micro_batch_key is None:
            return "none"
        return "replay" if torch.is_grad_enabled() else "record"

    def token_dispatch(self, permutated_local_input_tokens, permuted_probs):
        if getattr(self.config, "moe_fp4_experts", "bf16") == "fp8" and not self.layer_names_micro_batches:
            raise DispatchCacheError(
                "--moe-fp4-experts fp8 needs the plugin's layer spec (use_fp8_experts, as scripts/pretrain_gpt_fp4.py "
                "does); a Megatron tree patched with `megatron-fp4 patch` keeps Megatron's experts"
            )
        if (self.recompute_cache is not None or self.fp4_options.saved_input) and not self.layer_names_micro_batches:
            raise DispatchCacheError(
                "--moe-fp4-cache and --moe-fp4-saved-input need the plugin's FP4MoELayer (use_fp4_dispatch or "
                "scripts/pretrain_gpt_fp4.py), which names the micro-batch and installs the saved-tensor hooks; "
                "a patched Megatron MoELayer does not"
            )
        if self.shared_experts is not None:
            self.shared_experts.wait_current_stream()
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_ep_alltoall", self.tokens_per_expert)
        output_splits, input_splits = self._splits(permutated_local_input_tokens.shape[0])
        role = self._cache_role()
        if role == "replay":
            return self._replay_dispatch(permutated_local_input_tokens, permuted_probs, output_splits, input_splits)

        global_input_tokens, payload = fp4_dispatch_all_to_all(
            permutated_local_input_tokens,
            output_splits,
            input_splits,
            group=self.ep_group,
            scale_rule=self.fp4_options.scale_rule,
            grad_format=self.fp4_options.grad_format,
            dequantize=not self.payload_for_experts,  # FP8 experts read the payload, not these values
        )
        if self.shared_experts is not None:
            self.shared_experts.linear_fc1_forward_and_act(global_input_tokens)
        global_probs = all_to_all(
            self.ep_group, permuted_probs, self.output_splits, self.input_splits, use_nccl_stream=self.use_nccl_stream
        )
        if role == "record":
            entry = CachedDispatch(payload, tuple(output_splits), tuple(input_splits))
            self.recompute_cache.store(self.micro_batch_key, entry)
        self._keep_payload_for_experts(payload)
        return global_input_tokens, global_probs

    def _keep_payload_for_experts(self, payload) -> None:
        # FP8 experts compute from the payload; the saved-input hooks only matter in a pass with grad.
        if self.payload_for_experts or (self.fp4_options.saved_input and torch.is_grad_enabled()):
            self._received_payload = payload

    def take_expert_input(self):
        """(the experts' input, its payload rows in the same order), once; None when nothing was kept."""
        entry, self.expert_input_payload = self.expert_input_payload, None
        return entry

    def dispatch_postprocess(self, global_input_tokens, global_probs):
        tokens, tokens_per_expert, probs = super().dispatch_postprocess(global_input_tokens, global_probs)
        payload, self._received_payload = self._received_payload, None
        if payload is not None and self.num_local_experts > 1:
            # The parent sorted the tokens by local expert (its host sync is behind us): same for the rows.
            rows, _ = sort_chunks_by_idxs(payload.rows, self.num_global_tokens_per_local_expert.ravel(),
                                          self.sort_input_by_local_experts, fused=False)
            payload = MXFP4Tensor(rows, payload.hidden, payload.scale_rule)
        self.expert_input_payload = (tokens, payload) if payload is not None else None
        return tokens, tokens_per_expert, probs

    def _replay_dispatch(self, permutated_local_input_tokens, permuted_probs, output_splits, input_splits):
        """The recompute pass: the tokens the first pass received, from the cache; no token
        all-to-all forward. The gradients still go back through the reversed all-to-alls."""
        hidden = permutated_local_input_tokens.shape[1]
        entry = self.recompute_cache.take(self.micro_batch_key, output_splits, input_splits, hidden)
        global_input_tokens = replay_tokens(
            permutated_local_input_tokens, entry.payload, output_splits, input_splits, self.ep_group,
            self.fp4_options.grad_format, dequantize=not self.payload_for_experts,
        )
        if self.shared_experts is not None:
            self.shared_experts.linear_fc1_forward_and_act(global_input_tokens)
        # The probs are sent again (4 bytes per row), not cached: Megatron's router sorts its top-k
        # only with grad on (torch.topk(sorted=torch.is_grad_enabled())), so the first pass and
        # the recompute can sum the top-k in different orders and differ by one BF16 unit; the
        # recompute's own probs are what an uncached run uses.
        global_probs = all_to_all(
            self.ep_group, permuted_probs, self.output_splits, self.input_splits, use_nccl_stream=self.use_nccl_stream
        )
        self._keep_payload_for_experts(entry.payload)
        return global_input_tokens, global_probs


__all__ = ["FP4AlltoAllTokenDispatcher"]
