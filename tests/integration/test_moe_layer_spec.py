"""Registration through the layer spec: every MoELayer builder becomes FP4MoELayer with our options,
nothing else changes, and with the flag off the spec is returned untouched. (Building the layer
needs CUDA streams: tests/distributed runs it, on GPUs or emulated.)"""

import functools
from types import SimpleNamespace

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs, get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_fp4.integration import FP4MoELayer, FP4Options, use_fp4, use_fp4_dispatch
from megatron_fp4.options import ExpertsPrecision, GradFormat, ScaleRule


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
    options = FP4Options(dispatch=True, scale_rule="floor", dispatch_grad="fp8")
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
    spec = use_fp4_dispatch(get_gpt_layer_local_spec(num_experts=8), FP4Options(dispatch=True))
    assert isinstance(spec.submodules.mlp, functools.partial)
    assert spec.submodules.mlp.func is FP4MoELayer
    options = spec.submodules.mlp.keywords["fp4_options"]
    assert (options.scale_rule, options.dispatch_grad) == (ScaleRule.CEIL, GradFormat.BF16)


def test_switch_off_returns_the_same_spec_object():
    block = _block_spec()
    args = SimpleNamespace(moe_fp4_dispatch=False, moe_fp4_scale_rule="floor", moe_fp4_dispatch_grad="fp8")
    assert use_fp4(block, FP4Options.from_args(args)) is block
    assert use_fp4_dispatch(block, FP4Options(experts="fp8")) is block


def test_use_fp4_swaps_layer_and_experts_as_the_options_ask():
    from megatron_fp4.experts import FP8Experts

    block = _block_spec()
    both = _mlp_builders(use_fp4(block, FP4Options(dispatch=True, experts=ExpertsPrecision.FP8)))
    baseline = _mlp_builders(use_fp4(block, FP4Options(experts=ExpertsPrecision.FP8)))
    for mlp in both[1:]:
        assert mlp.func is FP4MoELayer and mlp.keywords["submodules"].experts.func is FP8Experts
    for mlp in baseline[1:]:  # the FP8 baseline: stock layer and dispatch, our experts
        assert mlp.func is MoELayer and mlp.keywords["submodules"].experts.func is FP8Experts
