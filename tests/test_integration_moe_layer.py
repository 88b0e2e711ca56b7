"""Registration through the layer spec: every MoELayer builder becomes FP4MoELayer with our options,
nothing else changes, and with the flag off the spec is returned untouched. (Building the layer
needs CUDA streams: tests/test_gpu_moe_layer.py does that on the GPU.)"""

import functools
from types import SimpleNamespace

import pytest
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs, get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_fp4.integration import FP4DispatchOptions, FP4MoELayer, use_fp4_dispatch


def _block_spec():
    config = TransformerConfig(
        num_layers=4, hidden_size=256, num_attention_heads=4, num_moe_experts=8, moe_layer_freq=[0, 1, 1, 1],
        moe_ffn_hidden_size=128, moe_shared_expert_intermediate_size=128, moe_router_topk=2,
    )
    return TransformerBlockSubmodules(layer_specs=get_gpt_decoder_layer_specs(config, use_transformer_engine=False))


def _mlp_builders(block):
    return [layer.submodules.mlp for layer in block.layer_specs]


def test_block_spec_moe_layers_swapped_dense_kept_original_untouched():
    block = _block_spec()
    options = FP4DispatchOptions(scale_rule="floor", grad_format="fp8")
    swapped = use_fp4_dispatch(block, options)

    before, after = _mlp_builders(block), _mlp_builders(swapped)
    assert [b.func for b in before[1:]] == [MoELayer] * 3
    assert [a.func for a in after[1:]] == [FP4MoELayer] * 3
    for old, new in zip(before[1:], after[1:]):
        assert new.keywords["fp4_options"] is options
        assert "fp4_options" not in old.keywords
        # The experts, router and shared experts are Megatron's, as they were.
        assert new.keywords["submodules"].experts.func is old.keywords["submodules"].experts.func
        assert new.keywords["submodules"].router is old.keywords["submodules"].router
    # The dense first layer is left alone (same builder and arguments).
    assert after[0].func == before[0].func and after[0].keywords == before[0].keywords


def test_layer_spec_swapped():
    spec = use_fp4_dispatch(get_gpt_layer_local_spec(num_experts=8), FP4DispatchOptions())
    assert isinstance(spec.submodules.mlp, functools.partial)
    assert spec.submodules.mlp.func is FP4MoELayer
    assert spec.submodules.mlp.keywords["fp4_options"] == FP4DispatchOptions("ceil", "bf16")


def test_switch_off_returns_the_same_spec_object():
    block = _block_spec()
    assert use_fp4_dispatch(block, None) is block
    args = SimpleNamespace(moe_fp4_dispatch=False, moe_fp4_scale_rule="floor", moe_fp4_dispatch_grad="fp8")
    assert FP4DispatchOptions.from_args(args) is None


def test_options_from_args_and_validation():
    args = SimpleNamespace(moe_fp4_dispatch=True, moe_fp4_scale_rule="floor", moe_fp4_dispatch_grad="fp8")
    assert FP4DispatchOptions.from_args(args) == FP4DispatchOptions("floor", "fp8")
    with pytest.raises(ValueError, match="scale_rule"):
        FP4DispatchOptions(scale_rule="nearest")
    with pytest.raises(ValueError, match="grad_format"):
        FP4DispatchOptions(grad_format="fp16")
