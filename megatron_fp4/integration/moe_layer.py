"""Registration: a MoELayer subclass that dispatches in FP4, injected through the layer spec.

`use_fp4_dispatch(spec, options)` returns a copy of a GPT layer/block/MTP spec in which every
`MoELayer` is `FP4MoELayer` with `fp4_options=options`. Nothing in megatron-core is edited or
patched; with options None the spec comes back untouched and the model is stock Megatron.
"""

import functools

import torch
from typing import Optional

from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.spec_utils import ModuleSpec

from ..dispatch.cache import MicroBatchKey
from ..dispatch.options import FP4DispatchOptions
from ..dispatch.saved_fp4 import FP4SavedRows
from ..dispatch.token_dispatcher import FP4AlltoAllTokenDispatcher
from ..experts import FP8Experts
from .spec_tree import rewrite_spec


class FP4MoELayer(MoELayer):
    """Megatron's MoELayer whose all-to-all dispatcher sends tokens in MXFP4. Everything else
    (router, experts, shared experts, combine, recompute) is the parent's."""

    def __init__(self, config, *args, fp4_options: Optional[FP4DispatchOptions] = None, **kwargs):
        if config.moe_token_dispatcher_type != "alltoall":
            raise ValueError(
                "FP4 dispatch needs moe_token_dispatcher_type 'alltoall' "
                f"(got {config.moe_token_dispatcher_type!r}): it replaces that dispatcher's all-to-all"
            )
        if config.transformer_impl == "inference_optimized":
            raise ValueError("FP4 dispatch is for training; transformer_impl 'inference_optimized' is not supported")
        super().__init__(config, *args, **kwargs)
        pg_collection = kwargs.get("pg_collection")
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        # The parent built a stock dispatcher (a few small index tensors); replace it by ours.
        self.token_dispatcher = FP4AlltoAllTokenDispatcher(
            self.num_local_experts,
            self.local_expert_indices,
            config=self.config,
            pg_collection=pg_collection,
            options=fp4_options,
        )
        self.token_dispatcher.layer_names_micro_batches = True  # see route()
        if isinstance(self.experts, FP8Experts):
            self._feed_fp8_experts_from_payload(config, self.token_dispatcher.fp4_options)
        if self.shared_experts is not None and self.shared_expert_overlap:
            self.token_dispatcher.set_shared_experts(self.shared_experts)

    def _feed_fp8_experts_from_payload(self, config, options: FP4DispatchOptions) -> None:
        """The FP8 experts read the received MXFP4 payload, sorted like their input, instead of BF16."""
        if options.saved_input:
            raise ValueError("--moe-fp4-saved-input is for Megatron's BF16 experts; the FP8 experts "
                             "(--moe-fp4-experts fp8) already keep their saved input in FP4")
        if config.moe_permute_fusion or self.token_dispatcher.drop_and_pad:
            raise ValueError(
                "--moe-fp4-experts fp8 behind --moe-fp4-dispatch does not support --moe-permute-fusion or "
                "--moe-pad-expert-input-to-capacity yet: the payload rows are reordered like the experts' "
                "input by the unfused sort"
            )
        self.token_dispatcher.payload_for_experts = True
        self.experts.payload_source = self.token_dispatcher.take_expert_input

    def forward(self, hidden_states, *args, **kwargs):
        # A checkpointed layer's first pass runs without grad inside a forward that has it; a
        # forward the caller runs under no_grad has no recompute coming and must cache nothing.
        self._forward_has_grad = torch.is_grad_enabled()
        return super().forward(hidden_states, *args, **kwargs)

    def routed_experts_compute(self, hidden_states, probs):
        dispatcher = self.token_dispatcher
        if not dispatcher.fp4_options.saved_input or not torch.is_grad_enabled():
            return super().routed_experts_compute(hidden_states, probs)
        # The experts' input exists only once dispatch_postprocess has run inside the parent's
        # method, so the hooks look it up lazily.
        with torch.autograd.graph.saved_tensors_hooks(self._pack_expert_input, FP4SavedRows.unpack):
            try:
                return super().routed_experts_compute(hidden_states, probs)
            finally:
                dispatcher.expert_input_payload = None

    def _pack_expert_input(self, t):
        expert_input = self.token_dispatcher.expert_input_payload
        if expert_input is None:
            return t
        return FP4SavedRows(*expert_input).pack(t)

    def route(self, hidden_states, *args, **kwargs):
        # Both passes of a checkpointed layer route the same input storage (the recompute gets the
        # saved input back, detached): that names the micro-batch for the dispatcher's cache. The
        # recompute is the pass with grad on (Megatron re-runs the layer's body, not forward()).
        dispatcher = self.token_dispatcher
        if dispatcher.recompute_cache is not None:
            checkpointed = getattr(self, "moe_layer_recompute", False) and self.training
            first_or_recompute = torch.is_grad_enabled() or getattr(self, "_forward_has_grad", False)
            dispatcher.micro_batch_key = (
                MicroBatchKey.of(hidden_states) if checkpointed and first_or_recompute else None
            )
        return super().route(hidden_states, *args, **kwargs)


def _fp4_moe_layer(options: FP4DispatchOptions):
    """A rewrite_spec hook that builds FP4MoELayer(fp4_options=options) where the spec builds MoELayer."""

    def rewrite(node):
        if isinstance(node, functools.partial) and node.func is MoELayer:
            return functools.partial(FP4MoELayer, *node.args, **{**node.keywords, "fp4_options": options})
        if isinstance(node, ModuleSpec) and node.module is MoELayer:
            node.module = FP4MoELayer
            node.params = {**node.params, "fp4_options": options}
        return node

    return rewrite


def use_fp4_dispatch(spec, options: Optional[FP4DispatchOptions]):
    """`spec` (ModuleSpec, TransformerBlockSubmodules or an MTP block spec) with every MoELayer
    dispatching in FP4; unchanged (the same object) when options is None."""
    if options is None or spec is None:
        return spec
    return rewrite_spec(spec, _fp4_moe_layer(options))


def count_fp4_moe_layers(model) -> int:
    """How many MoE layers of a built model dispatch in FP4 (for the launcher's start-up line)."""
    return sum(isinstance(m, FP4MoELayer) for m in model.modules())


__all__ = ["FP4MoELayer", "count_fp4_moe_layers", "use_fp4_dispatch"]
