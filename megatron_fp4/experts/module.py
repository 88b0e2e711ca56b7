"""FP8Experts: Megatron's SequentialMLP with the same parameters and checkpoint keys, computing in
FP8 from the MXFP4 dispatch payload (see function.py).

Built by the layer spec (`use_fp8_experts`, --moe-fp4-experts fp8). Behind FP4MoELayer the
layer passes the received payload, sorted like the experts' input, as the `payload` argument;
behind a stock MoELayer (BF16 dispatch: the "FP8 baseline") there is none and the experts
quantize their BF16 input themselves.
"""

import copy
from typing import Optional

import torch
from megatron.core.transformer.moe.experts import SequentialMLP

from .checkpoint_format import check_optimizer_checkpoint_format
from ..fp8 import TokenSegments, step_cache
from ..options import ExpertsPrecision, FP4Options, ModelSettings, Route, Storage, validate
from ..recompute_scope import recomputed_by
from ..telemetry import Telemetry
from ..tensors import MXFP4Tensor
from .function import ExpertGemms, ExpertsCall, FP8ExpertsFunction


class FP8Experts(SequentialMLP):
    def __init__(self, num_local_experts: int, config, submodules, pg_collection=None, name: Optional[str] = None,
                 options: FP4Options = FP4Options(experts=ExpertsPrecision.FP8),
                 gemms: ExpertGemms = ExpertGemms.GROUPED):
        validate(options, ModelSettings.from_config(config), None, Route.PLUGIN)
        # The linear layers only hold the weights here (their forward never runs), so they need not
        # check for apex's fused wgrad kernel; main_grad accumulation is done by our backward.
        holder_config = copy.copy(config)
        holder_config.gradient_accumulation_fusion = False
        super().__init__(num_local_experts, holder_config, submodules, pg_collection=pg_collection, name=name)
        self.accumulate_in_main_grad = bool(config.gradient_accumulation_fusion)
        # The MXFP4 rule for the activations these experts save (the payload brings its own).
        self.scale_rule = options.scale_rule
        self.weight_cache = step_cache(options)
        # Under `moe` recompute the experts run inside Megatron's checkpoint: no inexact FP4 there;
        # --moe-fp4-storage none asks for none anywhere.
        self.fp4_activations = options.storage is not Storage.NONE and not recomputed_by(frozenset({"moe"}), config)
        # --moe-fp4-recompute-experts: only the fc1 input kept, backward recomputes fc1 and the SwiGLU.
        self.recompute = options.recompute_experts
        self.gemms = gemms  # the benchmarks compare both; a spec builds the default
        # The linear layers holding the weights, each expert's fc1 then fc2, listed once: looking them
        # up per forward cost ~0.2 ms of host at 32 experts on an H200 machine, time the GPU waits
        # for right after the dispatcher's host sync.
        self._weight_holders = tuple(holder for expert in self.local_experts
                                     for holder in (expert.linear_fc1, expert.linear_fc2))

    def _run_weight_holders_pre_hooks(self) -> None:
        """The linear layers' forward never runs, but hooks on it may guard their weights: Megatron's
        DDP with --overlap-param-gather waits for a layer's parameter all-gather in a forward
        pre-hook. Run them as a forward of those layers would, before the weights are read."""
        for holder in self._weight_holders:
            hooks = holder._forward_pre_hooks
            if hooks:
                for hook in list(hooks.values()):
                    hook(holder, ())

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs,
                payload: Optional[MXFP4Tensor] = None, telemetry: Optional[Telemetry] = None, **kwargs):
        """payload: the MXFP4 rows whose dequantization permuted_local_hidden_states is (then its
        values are not read), or None to quantize permuted_local_hidden_states here. telemetry:
        where to count the MXFP4 activations kept for backward (--moe-fp4-telemetry)."""
        if kwargs:
            raise ValueError(f"FP8Experts does not support the experts' extra arguments {sorted(kwargs)}")
        self._run_weight_holders_pre_hooks()
        tokens = permuted_local_hidden_states
        if payload is not None and payload.shape != tokens.shape:
            raise ValueError(f"FP8Experts: payload {payload.shape} does not match the tokens {tuple(tokens.shape)}")
        segments = TokenSegments.of(tokens_per_expert, tokens.device)
        if segments.num_tokens != tokens.shape[0] or len(segments.counts) != self.num_local_experts:
            raise ValueError(f"FP8Experts: tokens_per_expert {segments.counts} does not describe "
                             f"{tokens.shape[0]} tokens over {self.num_local_experts} experts")
        weights = [holder.weight for holder in self._weight_holders[0::2]]
        weights += [holder.weight for holder in self._weight_holders[1::2]]
        # Decided here: inside the autograd function grad mode is always off.
        backward_follows = torch.is_grad_enabled() and (
            tokens.requires_grad or permuted_probs.requires_grad or any(w.requires_grad for w in weights))
        call = ExpertsCall(segments, payload.scale_rule if payload is not None else self.scale_rule,
                           float(self.config.glu_linear_offset), self.accumulate_in_main_grad, backward_follows,
                           self.weight_cache, self.gemms, telemetry, self.fp4_activations, self.recompute)
        output = FP8ExpertsFunction.apply(call, tokens, permuted_probs,
                                          payload.rows if payload is not None else None, *weights)
        return output, None

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        # Megatron passes the distributed optimizer's checkpoint format here at save and at load.
        check_optimizer_checkpoint_format(metadata)
        return super().sharded_state_dict(prefix, sharded_offsets, metadata)

    def backward_dw(self):
        raise RuntimeError("FP8Experts computes weight gradients in backward (no delayed wgrad)")
