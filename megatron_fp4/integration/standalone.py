"""One MoE layer outside a GPT model, built the way TransformerLayer builds its MLP: for the GPU
equality test and the layer benchmark. Uses Megatron's local spec (SequentialMLP experts), which
needs neither Transformer Engine nor apex."""

from typing import Optional

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

from ..dispatch.options import FP4DispatchOptions
from .experts_spec import use_fp8_experts
from .moe_layer import use_fp4_dispatch


def build_moe_layer(config, fp4_options: Optional[FP4DispatchOptions] = None, layer_number: int = 1,
                    experts: str = "bf16"):
    """A MoELayer for `config` (parallel state initialized), FP4MoELayer when fp4_options is given;
    experts "fp8" builds FP8Experts instead of Megatron's SequentialMLP."""
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts)
    spec = use_fp8_experts(use_fp4_dispatch(spec, fp4_options), experts)
    layer = spec.submodules.mlp(config=config)
    layer.set_layer_number(layer_number)
    return layer


__all__ = ["build_moe_layer"]
