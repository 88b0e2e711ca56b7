"""One MoE layer outside a GPT model, built the way TransformerLayer builds its MLP: for the GPU
equality test and the layer benchmark. Uses Megatron's local spec (SequentialMLP experts), which
needs neither Transformer Engine nor apex."""

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import build_module

from ..options import FP4Options
from . import use_fp4


def build_moe_layer(config, options: FP4Options = FP4Options(), layer_number: int = 1):
    """A MoELayer for `config` (parallel state initialized) as `options` ask: FP4MoELayer with
    options.dispatch, FP8Experts with options.experts fp8, else Megatron's own."""
    layer = _local_layer_spec(config, options).submodules.mlp(config=config)
    layer.set_layer_number(layer_number)
    return layer


def build_transformer_layer(config, options: FP4Options = FP4Options(), layer_number: int = 1):
    """A whole TransformerLayer of Megatron's local spec (attention, layer norms, MoE) with the MoE
    as build_moe_layer makes it: for tests of what the layer around the MoE does (e.g. the
    `layernorm` recompute freeing and regrowing the MoE input's storage)."""
    return build_module(_local_layer_spec(config, options), config=config, layer_number=layer_number)


def _local_layer_spec(config, options):
    return use_fp4(get_gpt_layer_local_spec(num_experts=config.num_moe_experts), options)


__all__ = ["build_moe_layer", "build_transformer_layer"]
