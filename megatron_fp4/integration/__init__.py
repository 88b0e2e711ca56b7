"""Glue between megatron_fp4 and Megatron-Core: the layer-spec swap and the MoE layer.

`use_fp4(spec, options)` is the one call a training script needs (see megatron_fp4.launch).
"""

from ..options import FP4Options
from .attention_spec import use_fused_attention
from .experts_spec import use_fp8_experts, use_recomputed_experts
from .linears_spec import use_fp8_linears
from .moe_layer import FP4MoELayer, use_fp4_dispatch


def use_fp4(spec, options: FP4Options):
    """`spec` (a layer, block or MTP block spec) as `options` ask: MoE layers dispatching in MXFP4
    (options.dispatch), their experts in FP8 (options.experts), the other linear layers in FP8
    (options.linears), the core attention on fused kernels (options.fused_attention), Megatron's own
    experts recomputed (options.recompute_experts); the same object when stock."""
    spec = use_recomputed_experts(use_fp8_experts(use_fp4_dispatch(spec, options), options), options)
    spec = use_fp8_linears(spec, options)
    return use_fused_attention(spec, options)


__all__ = ["FP4MoELayer", "FP4Options", "use_fp4", "use_fp4_dispatch", "use_fp8_experts",
           "use_fp8_linears", "use_fused_attention", "use_recomputed_experts"]
