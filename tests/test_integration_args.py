"""Flag parsing and the configurations the FP4 dispatcher refuses."""

import argparse
from types import SimpleNamespace

import pytest

from megatron_fp4.integration import FP4DispatchUnsupported, add_fp4_args, check_fp4_dispatch_supported


def _parse(argv):
    return add_fp4_args(argparse.ArgumentParser()).parse_args(argv)


def test_flags_default_off_and_parse():
    args = _parse([])
    assert (args.moe_fp4_dispatch, args.moe_fp4_dispatch_grad, args.moe_fp4_scale_rule) == (False, "bf16", "ceil")
    args = _parse(["--moe-fp4-dispatch", "--moe-fp4-dispatch-grad", "fp8", "--moe-fp4-scale-rule", "floor"])
    assert (args.moe_fp4_dispatch, args.moe_fp4_dispatch_grad, args.moe_fp4_scale_rule) == (True, "fp8", "floor")
    with pytest.raises(SystemExit):
        _parse(["--moe-fp4-dispatch-grad", "fp16"])


def _config(**overrides):
    base = dict(moe_fp4_dispatch=True, num_experts=32, moe_token_dispatcher_type="alltoall", hidden_size=7168,
                expert_tensor_parallel_size=1)
    base.update(overrides)
    return SimpleNamespace(**base)


def _check(config, version="0.19.2", cuda=True):
    check_fp4_dispatch_supported(config, megatron_core_version=version, cuda_available=cuda)


def test_a_supported_configuration_passes_and_off_is_never_checked():
    _check(_config())
    _check(_config(moe_token_dispatcher_type="allgather", moe_fp4_dispatch=False), version="0.9.0", cuda=False)


@pytest.mark.parametrize(
    "overrides, version, cuda, message",
    [
        ({"moe_token_dispatcher_type": "allgather"}, "0.19.2", True, "alltoall"),
        ({"moe_token_dispatcher_type": "flex"}, "0.19.2", True, "alltoall"),
        ({"hidden_size": 4000}, "0.19.2", True, "divisible by 128"),
        ({"expert_tensor_parallel_size": 2}, "0.19.2", True, "expert tensor parallelism"),
        ({"num_experts": None}, "0.19.2", True, "MoE model"),
        ({}, "0.16.0", True, "supports megatron-core 0.17 to 0.19"),
        ({}, "0.20.0rc1", True, "supports megatron-core 0.17 to 0.19"),
        ({}, "0.19.2", False, "CUDA"),
    ],
)
def test_refusals_say_what_and_why(overrides, version, cuda, message):
    with pytest.raises(FP4DispatchUnsupported, match=message):
        _check(_config(**overrides), version=version, cuda=cuda)


def test_installed_megatron_core_is_supported():
    import megatron.core

    check_fp4_dispatch_supported(_config(), megatron_core_version=megatron.core.__version__, cuda_available=True)


def test_cache_flag_needs_dispatch_and_moe_recompute():
    args = _parse(["--moe-fp4-cache"])
    assert args.moe_fp4_cache is True and _parse([]).moe_fp4_cache is False
    with pytest.raises(FP4DispatchUnsupported, match="--moe-fp4-cache needs --moe-fp4-dispatch"):
        _check(_config(moe_fp4_dispatch=False, moe_fp4_cache=True))
    with pytest.raises(FP4DispatchUnsupported, match="--recompute-modules moe"):
        _check(_config(moe_fp4_cache=True, recompute_granularity="selective", recompute_modules=["mlp"]))
    _check(_config(moe_fp4_cache=True, recompute_granularity="selective", recompute_modules=["moe", "layernorm"]))
    # Token dropping keeps tokens by probability, which the recompute may compute one BF16 unit apart.
    with pytest.raises(FP4DispatchUnsupported, match="--moe-expert-capacity-factor"):
        _check(_config(moe_fp4_cache=True, recompute_granularity="selective", recompute_modules=["moe"],
                       moe_expert_capacity_factor=1.0))


def test_saved_input_flag_needs_dispatch_and_no_permute_fusion():
    assert _parse(["--moe-fp4-saved-input"]).moe_fp4_saved_input is True
    with pytest.raises(FP4DispatchUnsupported, match="--moe-fp4-saved-input needs --moe-fp4-dispatch"):
        _check(_config(moe_fp4_dispatch=False, moe_fp4_saved_input=True))
    with pytest.raises(FP4DispatchUnsupported, match="--moe-permute-fusion"):
        _check(_config(moe_fp4_saved_input=True, moe_permute_fusion=True))
    _check(_config(moe_fp4_saved_input=True, moe_permute_fusion=False))


def _fp8_experts(**overrides):
    settings = dict(moe_fp4_experts="fp8", swiglu=True, add_bias_linear=False, moe_ffn_hidden_size=2048)
    settings.update(overrides)
    return _config(**settings)


def test_fp8_experts_flag_parses_and_works_with_and_without_fp4_dispatch():
    assert _parse([]).moe_fp4_experts == "bf16"
    assert _parse(["--moe-fp4-experts", "fp8"]).moe_fp4_experts == "fp8"
    with pytest.raises(SystemExit):
        _parse(["--moe-fp4-experts", "fp4"])
    _check(_fp8_experts())
    _check(_fp8_experts(moe_fp4_dispatch=False))  # the FP8 baseline: BF16 dispatch, our experts


@pytest.mark.parametrize("overrides, message", [
    ({"swiglu": False}, "SwiGLU"),
    ({"add_bias_linear": True}, "disable-bias-linear"),
    ({"moe_fp4_saved_input": True}, "already keeps its saved input in FP4"),
    ({"expert_tensor_parallel_size": 2}, "expert tensor parallelism"),
    ({"moe_permute_fusion": True}, "--moe-permute-fusion"),
    ({"moe_ffn_hidden_size": 1000}, "--moe-ffn-hidden-size divisible by 128"),
    ({"num_experts": None, "moe_fp4_dispatch": False}, "MoE model"),
    ({"moe_apply_probs_on_input": True}, "--moe-apply-probs-on-input"),
    ({"delay_wgrad_compute": True}, "--delay-wgrad-compute"),
    ({"activation_func_clamp_value": 7.0}, "--activation-func-clamp-value"),
    ({"recompute_granularity": "selective", "recompute_modules": ["moe_act"]}, "drop moe_act"),
    ({"moe_pad_expert_input_to_capacity": True}, "--moe-pad-expert-input-to-capacity"),
])
def test_fp8_experts_refusals(overrides, message):
    with pytest.raises(FP4DispatchUnsupported, match=message):
        _check(_fp8_experts(**overrides))
