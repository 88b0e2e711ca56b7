"""One MoE layer outside a GPT model, built the way TransformerLayer builds its MLP: for the GPU
equality test and the layer benchmark. Uses Megatron's local spec (SequentialMLP experts), which
needs neither Transformer Engine nor apex."""

from typing import Optional

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import build_module

from ..dispatch.options import FP4DispatchOptions
from .experts_spec import use_fp8_experts
from .moe_layer import use_fp4_dispatch


def build_moe_layer(config, fp4_options: Optional[FP4DispatchOptions] = None, layer_number: int = 1,
                    experts: str = "bf16"):
    """A MoELayer for `config` (parallel state initialized), FP4MoELayer when fp4_options is given;
    experts "fp8" builds FP8Experts instead of Megatron's SequentialMLP."""
    layer = _local_layer_spec(config, fp4_options, experts).submodules.mlp(config=config)
    layer.set_layer_number(layer_number)
    return layer


def build_transformer_layer(config, fp4_options: Optional[FP4DispatchOptions] = None, layer_number: int = 1,
                            experts: str = "bf16"):
    """A whole TransformerLayer of Megatron's local spec (attention, layer norms, MoE) with the MoE
    as build_moe_layer makes it: for tests of what the layer around the MoE does (e.g. the
    `layernorm` recompute freeing and regrowing the MoE input's storage)."""
    return build_module(_local_layer_spec(config, fp4_options, experts), config=config, layer_number=layer_number)


def _local_layer_spec(config, fp4_options, experts):
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts)
    return use_fp8_experts(use_fp4_dispatch(spec, fp4_options), experts)


__all__ = ["build_moe_layer", "build_transformer_layer"]
