"""FP8Experts: Megatron's SequentialMLP with the same parameters and checkpoint keys, computing in
FP8 from the MXFP4 dispatch payload (see function.py).

Built by the layer spec (`use_fp8_experts`, --moe-fp4-experts fp8). Behind FP4MoELayer the
dispatcher hands over the received payload, sorted like the experts' input; behind a stock
MoELayer (BF16 dispatch: the "FP8 baseline") the experts quantize their BF16 input themselves.
"""

import copy
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

from ..formats import FP8_BLOCK
from ..tensors import MXFP4Tensor
from .function import ExpertsCall, FP8ExpertsFunction
from .segments import ExpertSegments

PayloadSource = Callable[[], Optional[Tuple[torch.Tensor, MXFP4Tensor]]]


def check_fp8_experts_supported(config) -> None:
    """One sentence per configuration the FP8 experts cannot serve."""
    if not config.gated_linear_unit or config.activation_func is not F.silu:
        raise ValueError("--moe-fp4-experts fp8 implements SwiGLU experts only (--swiglu: gated linear unit with silu)")
    if getattr(config, "activation_func_clamp_value", None) is not None:
        raise ValueError("--moe-fp4-experts fp8 does not support --activation-func-clamp-value")
    if config.add_bias_linear:
        raise ValueError("--moe-fp4-experts fp8 has no expert biases; use --disable-bias-linear")
    if config.moe_apply_probs_on_input:
        raise ValueError("--moe-fp4-experts fp8 applies the probs after SwiGLU; --moe-apply-probs-on-input is not supported")
    if getattr(config, "delay_wgrad_compute", False):
        raise ValueError("--moe-fp4-experts fp8 computes weight gradients in backward; --delay-wgrad-compute is not supported")
    for name in ("moe_latent_size" if getattr(config, "moe_latent_size", None) else "hidden_size", "moe_ffn_hidden_size"):
        if getattr(config, name) % FP8_BLOCK:
            raise ValueError(f"--moe-fp4-experts fp8 needs {name} divisible by {FP8_BLOCK}, got {getattr(config, name)}")


class FP8Experts(SequentialMLP):
    def __init__(self, num_local_experts: int, config, submodules, pg_collection=None, name: Optional[str] = None):
        check_fp8_experts_supported(config)
        # The linear layers only hold the weights here (their forward never runs), so they need not
        # check for apex's fused wgrad kernel; main_grad accumulation is done by our backward.
        holder_config = copy.copy(config)
        holder_config.gradient_accumulation_fusion = False
        super().__init__(num_local_experts, holder_config, submodules, pg_collection=pg_collection, name=name)
        self.accumulate_in_main_grad = bool(config.gradient_accumulation_fusion)
        if self.tp_group.size() > 1:
            raise ValueError(f"--moe-fp4-experts fp8 does not support expert tensor parallelism (size "
                             f"{self.tp_group.size()}); use --expert-tensor-parallel-size 1")
        # Set by FP4MoELayer: returns (the experts' input, its MXFP4 payload rows in the same order).
        self.payload_source: Optional[PayloadSource] = None
        self.scale_rule = "ceil"

    def _payload_for(self, tokens: torch.Tensor) -> Optional[MXFP4Tensor]:
        if self.payload_source is None:
            return None
        entry = self.payload_source()
        if entry is None or entry[0] is not tokens:
            raise RuntimeError("FP8Experts: the FP4 dispatcher handed over no payload for these tokens "
                               "(was dispatch_postprocess bypassed?)")
        return entry[1]

    def _run_weight_holders_pre_hooks(self) -> None:
        """The linear layers' forward never runs, but hooks on it may guard their weights: Megatron's
        DDP with --overlap-param-gather waits for a layer's parameter all-gather in a forward
        pre-hook. Run them as a forward of those layers would, before the weights are read."""
        for expert in self.local_experts:
            for holder in (expert.linear_fc1, expert.linear_fc2):
                for hook in list(holder._forward_pre_hooks.values()):
                    hook(holder, ())

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs, **kwargs):
        if kwargs:
            raise ValueError(f"FP8Experts does not support the experts' extra arguments {sorted(kwargs)}")
        self._run_weight_holders_pre_hooks()
        tokens = permuted_local_hidden_states
        payload = self._payload_for(tokens)
        segments = ExpertSegments.of(tokens_per_expert, tokens.device)
        if segments.num_tokens != tokens.shape[0] or len(segments.counts) != self.num_local_experts:
            raise ValueError(f"FP8Experts: tokens_per_expert {segments.counts} does not describe "
                             f"{tokens.shape[0]} tokens over {self.num_local_experts} experts")
        weights = [expert.linear_fc1.weight for expert in self.local_experts]
        weights += [expert.linear_fc2.weight for expert in self.local_experts]
        # Decided here: inside the autograd function grad mode is always off.
        backward_follows = torch.is_grad_enabled() and (
            tokens.requires_grad or permuted_probs.requires_grad or any(w.requires_grad for w in weights))
        call = ExpertsCall(segments, payload.scale_rule if payload is not None else self.scale_rule,
                           float(self.config.glu_linear_offset), self.accumulate_in_main_grad, backward_follows)
        output = FP8ExpertsFunction.apply(call, tokens, permuted_probs,
                                          payload.rows if payload is not None else None, *weights)
        return output, None

    def backward_dw(self):
        raise RuntimeError("FP8Experts computes weight gradients in backward (no delayed wgrad)")
