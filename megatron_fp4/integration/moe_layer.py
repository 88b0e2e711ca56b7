"""FP4MoELayer: Megatron's MoELayer whose token dispatch travels in MXFP4, through the alltoall or
the flex (DeepEP) dispatcher (dispatch/factory.py picks ours for Megatron's dispatcher type; both
implement dispatch/contract.py).

The protocol, and the Megatron call order it relies on. MoELayer.forward (megatron-core 0.18-0.19,
its inner `custom_forward`) runs, each step handed the previous step's result directly:

    route(hidden) -> preprocess(hidden, probs, routing_map) -> dispatch(tokens, probs)
        -> routed_experts_compute(dispatched, probs) -> combine(output) -> postprocess(output, shared)

With `moe` recompute the whole sequence runs twice: a first pass under no_grad inside Megatron's
checkpoint and the recompute with grad on. This layer overrides the steps from preprocess on and
passes values along them in the tokens' place: `LayerForward` from preprocess (the tokens to send,
or, where the dispatcher permutes MXFP4 rows, those rows; with --moe-fp4-cache, the micro-batch
and the cache's role in this pass; a replayed pass quantizes nothing), to which dispatch adds what
arrived (`ReceivedTokens`: BF16 tokens, the MXFP4 payload and the dispatch's handle);
routed_experts_compute hands the experts their input (`ExpertsInput`, the payload sorted like the
tokens where the experts or the saved-input hooks use it) and returns a `PendingCombine`, the
output with the combine's handle, which combine and postprocess carry to the end. Nothing is set
on one object for another to read. With --moe-fp4-telemetry the layer records each training
pass's dispatch and cache use in the process's recorder (megatron_fp4.telemetry) and hands the
recorder to the experts and the saved-input hooks as an argument. A Megatron that put work between
these steps would meet one of these values where it expects a tensor and fail at once;
tests/integration pins the order.
Megatron's split schedule (--overlap-moe-expert-parallel-comm) calls the steps itself and CUDA
graphs capture them: both are refused by megatron_fp4.options.
"""

import dataclasses
import enum
import functools
from typing import Optional

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.spec_utils import ModuleSpec

from .. import telemetry
from ..dispatch.cache import CachedDispatch, DispatchCache, MicroBatchKey
from ..dispatch.deepep import require_covered_deep_ep
from ..dispatch.contract import PendingCombine, QuantizedPermute, ReceivedTokens
from ..dispatch.factory import fp4_token_dispatcher
from ..dispatch.saved_fp4 import FP4SavedRows
from ..options import ExpertsPrecision, FP4Options, Route
from .spec_tree import rewrite_spec


class CacheRole(enum.Enum):
    NONE = "none"  # not a checkpointed training pass: dispatch as usual
    RECORD = "record"  # a checkpointed layer's first (no-grad) pass: keep what arrives
    REPLAY = "replay"  # its recompute: take the first pass's tokens instead of sending them


@dataclasses.dataclass(frozen=True)
class LayerForward:
    """One pass of one FP4MoELayer, from preprocess to the experts."""

    tokens: torch.Tensor  # permuted tokens, grouped by destination rank (with `quantized`: the gradient path only)
    cache_role: CacheRole = CacheRole.NONE
    micro_batch: Optional[MicroBatchKey] = None
    received: Optional[ReceivedTokens] = None  # set by dispatch
    quantized: Optional[QuantizedPermute] = None  # the permute done on MXFP4 rows


class FP4MoELayer(MoELayer):
    """Router, experts, shared experts, combine and recompute stay the parent's."""

    def __init__(self, config, *args, fp4_options: FP4Options, **kwargs):
        if config.moe_token_dispatcher_type == "flex":
            # Before the parent builds Megatron's own flex dispatcher, whose DeepEP manager fails first.
            require_covered_deep_ep()
        super().__init__(config, *args, **kwargs)
        pg_collection = kwargs.get("pg_collection") or get_default_pg_collection()
        # The parent built a stock dispatcher (a few small index tensors); replace it by ours for
        # Megatron's dispatcher type, which validates the configuration against the options table.
        self.token_dispatcher = fp4_token_dispatcher(
            self.num_local_experts, self.local_expert_indices, self.config, pg_collection, fp4_options, Route.PLUGIN)
        if self.shared_experts is not None and self.shared_expert_overlap:
            self.token_dispatcher.set_shared_experts(self.shared_experts)
        self.options = fp4_options
        self.recompute_cache = (
            DispatchCache(f"MoE layer, experts {self.local_expert_indices[0]}..") if fp4_options.cache else None
        )
        # --moe-fp4-telemetry: the process's recorder, handed to what records (training passes only).
        self.telemetry = telemetry.recorder() if fp4_options.telemetry else None

    def _recording(self) -> Optional[telemetry.Telemetry]:
        return self.telemetry if self.training else None

    def _cache_role(self, hidden_states: torch.Tensor) -> CacheRole:
        """Megatron checkpoints the layer when moe_layer_recompute and training. Its first pass
        runs under no_grad on the layer input itself (which requires grad when a backward
        follows); the recompute gets that input back detached, same storage, with grad on. A
        forward the caller runs under no_grad has an input that requires no grad: no recompute
        comes, nothing is kept."""
        checkpointed = getattr(self, "moe_layer_recompute", False) and self.training
        if self.recompute_cache is None or not checkpointed or not hidden_states.requires_grad:
            return CacheRole.NONE
        return CacheRole.REPLAY if torch.is_grad_enabled() else CacheRole.RECORD

    def preprocess(self, hidden_states, probs, routing_map):
        role = self._cache_role(hidden_states)
        # Both passes see the same input storage: that names the micro-batch (see dispatch/cache.py).
        micro_batch = MicroBatchKey.of(hidden_states) if role is not CacheRole.NONE else None
        if not self.token_dispatcher.quantizes_before_permute():
            tokens, probs = super().preprocess(hidden_states, probs, routing_map)
            return LayerForward(tokens, role, micro_batch), probs
        quantized, probs = self.token_dispatcher.permute_quantized(
            hidden_states, routing_map, probs, quantize=role is not CacheRole.REPLAY)
        return LayerForward(quantized.tokens, role, micro_batch, quantized=quantized), probs

    def dispatch(self, forward: LayerForward, probs):
        replay = self.recompute_cache.take(forward.micro_batch) if forward.cache_role is CacheRole.REPLAY else None
        # Our FP8 experts compute from the payload; Megatron's need its BF16 dequantization.
        dequantize = self.options.experts is not ExpertsPrecision.FP8
        quantized = forward.quantized
        received, probs = self.token_dispatcher.dispatch_fp4(
            forward.tokens, probs, dequantize, replay, wire=None if quantized is None else quantized.wire)
        recording = self._recording()
        if forward.cache_role is CacheRole.RECORD:
            entry = CachedDispatch(received.payload, received.handle)
            self.recompute_cache.store(forward.micro_batch, entry)
            if recording is not None:
                recording.hold(entry.nbytes())
        if recording is not None:
            if replay is not None:
                recording.release(replay.nbytes())
            counted = recording.dispatched(forward.tokens, received.tokens, replay is not None,
                                           self.options.scale_rule, self.options.dispatch_grad,
                                           values=None if quantized is None else quantized.source)
            received = dataclasses.replace(received, tokens=counted)
        return dataclasses.replace(forward, received=received), probs

    def routed_experts_compute(self, forward: LayerForward, probs):
        dispatcher = self.token_dispatcher
        fp8_experts = self.options.experts is ExpertsPrecision.FP8
        saving_fp4 = self.options.saved_input and torch.is_grad_enabled()
        inputs = dispatcher.experts_input(forward.received, probs, sort_payload=fp8_experts or saving_fp4)
        tokens, tokens_per_expert, probs = inputs.tokens, inputs.tokens_per_expert, inputs.probs
        if fp8_experts:
            output, bias = self.experts(tokens, tokens_per_expert, probs, payload=inputs.payload,
                                        telemetry=self._recording())
        elif saving_fp4:
            with FP4SavedRows(tokens, inputs.payload, self._recording()):
                output, bias = self.experts(tokens, tokens_per_expert, probs)
        else:
            output, bias = self.experts(tokens, tokens_per_expert, probs)
        if bias is not None:
            raise RuntimeError(f"the experts returned a bias, which {type(dispatcher).__name__} cannot combine")
        return PendingCombine(dispatcher.combine_preprocess_fp4(output, inputs.handle), inputs.handle), bias

    def combine(self, pending: PendingCombine):
        return PendingCombine(self.token_dispatcher.token_combine_fp4(pending.tokens, pending.handle), pending.handle)

    def postprocess(self, pending: PendingCombine, shared_expert_output):
        """MoELayer.postprocess (training: the latent projection back, the shared experts' output
        added) on the combine that the handle finishes."""
        output = self.token_dispatcher.combine_postprocess_fp4(pending.tokens, pending.handle)
        if self.config.moe_latent_size:
            output, _ = self.fc2_latent_proj(output)
        if shared_expert_output is not None:
            output = output + shared_expert_output
        return output


def _fp4_moe_layer(options: FP4Options):
    """A rewrite_spec hook that builds FP4MoELayer(fp4_options=options) where the spec builds MoELayer."""

    def rewrite(node):
        if isinstance(node, functools.partial) and node.func is MoELayer:
            return functools.partial(FP4MoELayer, *node.args, **{**node.keywords, "fp4_options": options})
        if isinstance(node, ModuleSpec) and node.module is MoELayer:
            node.module = FP4MoELayer
            node.params = {**node.params, "fp4_options": options}
        return node

    return rewrite


def use_fp4_dispatch(spec, options: FP4Options):
    """`spec` (ModuleSpec, TransformerBlockSubmodules or an MTP block spec) with every MoELayer
    dispatching in FP4 when options.dispatch; otherwise the same object."""
    if not options.dispatch or spec is None:
        return spec
    return rewrite_spec(spec, _fp4_moe_layer(options))


__all__ = ["CacheRole", "FP4MoELayer", "LayerForward", "use_fp4_dispatch"]
