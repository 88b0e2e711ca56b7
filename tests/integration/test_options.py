"""The options table: flag parsing, FP4Options from args and from a config, and every refusal."""

import argparse
import warnings
from types import SimpleNamespace

import pytest

from megatron_fp4.options import (
    Environment,
    ExpertsPrecision,
    FP4Options,
    GradFormat,
    LinearRole,
    ModelSettings,
    Route,
    ScaleRule,
    UnsupportedConfiguration,
    add_arguments,
    validate,
    validate_args,
)


def _parse(argv):
    return add_arguments(argparse.ArgumentParser()).parse_args(argv)


def test_every_option_has_exactly_one_flag():
    # FP4Options.from_args reads one attribute per field: a field without a flag would never be set
    # from the command line, a flag without a field never read.
    from dataclasses import fields

    from megatron_fp4.options.flags import FLAGS

    flag_fields = [flag.field for flag in FLAGS]
    assert sorted(flag_fields) == sorted(f.name for f in fields(FP4Options))
    assert len(set(flag_fields)) == len(flag_fields)


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


def _check(config, version="0.19.2", cuda=True, route=Route.LAUNCHER, capability=(9, 0)):
    validate_args(config, route, Environment(version, cuda, capability if cuda else None))


def test_a_supported_configuration_passes_and_off_is_never_checked():
    _check(_config())
    _check(_config(moe_token_dispatcher_type="allgather", moe_fp4_dispatch=False), version="0.9.0", cuda=False)


@pytest.mark.parametrize(
    "overrides, version, cuda, message",
    [
        ({"moe_token_dispatcher_type": "allgather"}, "0.19.2", True, "alltoall"),
        ({"moe_token_dispatcher_type": "flex", "expert_model_parallel_size": 2}, "0.19.2", True, "needs --bf16"),  # DeepEP's combine: BF16 only
        ({"hidden_size": 4000}, "0.19.2", True, "divisible by 128"),
        ({"expert_tensor_parallel_size": 2}, "0.19.2", True, "expert tensor parallelism"),
        ({"num_experts": None}, "0.19.2", True, "MoE model"),
        ({}, "0.17.1", True, "supports megatron-core 0.18 to 0.19"),
        ({}, "0.20.0rc1", True, "supports megatron-core 0.18 to 0.19"),
        ({"overlap_moe_expert_parallel_comm": True}, "0.19.2", True, "--overlap-moe-expert-parallel-comm"),
        ({"cuda_graph_impl": "local", "cuda_graph_modules": []}, "0.19.2", True, "CUDA graphs"),
        ({"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": ["moe_router"]}, "0.19.2", True,
         "CUDA graphs"),
        ({"cuda_graph_impl": "full_iteration"}, "0.19.2", True, "CUDA graphs"),
        ({"context_parallel_size": 2}, "0.19.2", True, "--context-parallel-size 1"),
        ({"overlap_dispatch_backward_with_experts_wgrad": True}, "0.19.2", True,
         "--overlap-dispatch-backward-with-experts-wgrad"),
        ({"transformer_impl": "inference_optimized"}, "0.19.2", True, "--transformer-impl inference_optimized"),
        # The deprecated spelling, before Megatron's validation moves it (the estimator, --dry-run).
        ({"cuda_graph_impl": "local", "cuda_graph_scope_deprecated": ["moe"]}, "0.19.2", True, "CUDA graphs"),
        ({}, "0.19.2", False, "CUDA"),
    ],
)
def test_refusals_say_what_and_why(overrides, version, cuda, message):
    with pytest.raises(UnsupportedConfiguration, match=message):
        _check(_config(**overrides), version=version, cuda=cuda)


def test_installed_megatron_core_is_supported():
    import megatron.core

    _check(_config(), version=megatron.core.__version__)


def test_cuda_graphs_of_other_modules_pass():
    _check(_config(cuda_graph_impl="local", cuda_graph_modules=["attn"]))
    _check(_config(cuda_graph_impl="local", cuda_graph_scope_deprecated=["attn"], cuda_graph_modules=[]))
    _check(_config(cuda_graph_impl="none", cuda_graph_modules=[]))


def test_the_cache_needs_a_moe_recompute_that_megatron_keeps():
    """Megatron turns MoE-layer recompute off under local CUDA graphs: the cache would never engage."""
    recompute = dict(moe_fp4_cache=True, recompute_granularity="selective", recompute_modules=["moe"])
    _check(_config(**recompute))
    with pytest.raises(UnsupportedConfiguration, match="--recompute-modules moe"):
        _check(_config(**recompute, cuda_graph_impl="local", cuda_graph_modules=["attn"]))


def test_cache_flag_needs_dispatch_and_moe_recompute():
    args = _parse(["--moe-fp4-cache"])
    assert args.moe_fp4_cache is True and _parse([]).moe_fp4_cache is False
    with pytest.raises(UnsupportedConfiguration, match="--moe-fp4-cache needs --moe-fp4-dispatch"):
        _check(_config(moe_fp4_dispatch=False, moe_fp4_cache=True))
    with pytest.raises(UnsupportedConfiguration, match="--recompute-modules moe"):
        _check(_config(moe_fp4_cache=True, recompute_granularity="selective", recompute_modules=["mlp"]))
    _check(_config(moe_fp4_cache=True, recompute_granularity="selective", recompute_modules=["moe", "layernorm"]))
    # Token dropping keeps tokens by probability, which the recompute may compute one BF16 unit apart.
    with pytest.raises(UnsupportedConfiguration, match="--moe-expert-capacity-factor"):
        _check(_config(moe_fp4_cache=True, recompute_granularity="selective", recompute_modules=["moe"],
                       moe_expert_capacity_factor=1.0))


def test_saved_input_flag_needs_dispatch_and_no_permute_fusion():
    assert _parse(["--moe-fp4-saved-input"]).moe_fp4_saved_input is True
    with pytest.raises(UnsupportedConfiguration, match="--moe-fp4-saved-input needs --moe-fp4-dispatch"):
        _check(_config(moe_fp4_dispatch=False, moe_fp4_saved_input=True))
    with pytest.raises(UnsupportedConfiguration, match="--moe-permute-fusion"):
        _check(_config(moe_fp4_saved_input=True, moe_permute_fusion=True))
    _check(_config(moe_fp4_saved_input=True, moe_permute_fusion=False))


def test_telemetry_flag_needs_dispatch():
    assert _parse(["--moe-fp4-telemetry"]).moe_fp4_telemetry is True and _parse([]).moe_fp4_telemetry is False
    assert FP4Options.from_args(_parse(["--moe-fp4-dispatch", "--moe-fp4-telemetry"])).telemetry
    with pytest.raises(UnsupportedConfiguration, match="--moe-fp4-telemetry needs --moe-fp4-dispatch"):
        _check(_config(moe_fp4_dispatch=False, moe_fp4_telemetry=True))
    _check(_config(moe_fp4_telemetry=True))


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
    _check(_fp8_experts(moe_fp4_storage="none"))  # the MXFP4 dispatch, nothing inexact kept in MXFP4
    with pytest.raises(UnsupportedConfiguration, match="--moe-fp4-storage none"):
        _check(_config(moe_fp4_storage="none"))  # Megatron's BF16 experts keep nothing in MXFP4 anyway


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
    ({"overlap_moe_expert_parallel_comm": True, "moe_fp4_dispatch": False}, "--overlap-moe-expert-parallel-comm"),
    ({"moe_token_dispatcher_type": "flex", "moe_fp4_dispatch": False}, "does not take Megatron's own flex dispatcher"),
    ({"moe_fp4_storage": "none", "moe_fp4_dispatch": False}, "--moe-fp4-storage none .* needs --moe-fp4-dispatch"),
    ({"moe_fp4_keep_transposed_weights": True, "moe_fp4_weights_per_use": True}, "keeps two: drop one"),
])
def test_fp8_experts_refusals(overrides, message):
    with pytest.raises(UnsupportedConfiguration, match=message):
        _check(_fp8_experts(**overrides))


def _flex(**overrides):
    """--moe-fp4-dispatch through the flex dispatcher on DeepEP (Megatron's default flex backend), BF16."""
    return _config(**{"moe_token_dispatcher_type": "flex", "bf16": True, "expert_model_parallel_size": 2, **overrides})


@pytest.mark.parametrize("backend", [{}, {"moe_enable_deepep": True}, {"moe_flex_dispatcher_backend": "deepep"},
                                     # Megatron resolves the deprecated switch to deepep over the backend named
                                     {"moe_enable_deepep": True, "moe_flex_dispatcher_backend": "ncclep"}],
                         ids=["default", "enable-deepep", "backend-deepep", "enable-deepep-over-ncclep"])
def test_fp4_dispatch_through_flex_on_deepep_is_accepted(backend):
    _check(_flex(**backend))
    assert ModelSettings.from_args(_flex(**backend)).flex_backend == "deepep"
    # The FP8 experts fed from the received payload, the saved input, the scale rule: served through flex.
    _check(_flex(**backend, moe_fp4_experts="fp8", swiglu=True, add_bias_linear=False, moe_ffn_hidden_size=2048))
    _check(_flex(**backend, moe_fp4_saved_input=True, moe_fp4_scale_rule="floor"))
    _check(_flex(**backend, moe_fp4_cache=True, recompute_granularity="selective", recompute_modules=["moe"]))
    validate(FP4Options(dispatch=True), ModelSettings.from_args(_flex(**backend)), None, Route.PLUGIN)


@pytest.mark.parametrize("overrides, sentence", [
    ({"moe_flex_dispatcher_backend": "hybridep"},
     "--moe-fp4-dispatch through the flex dispatcher serves its DeepEP backend only (got "
     "--moe-flex-dispatcher-backend hybridep)."),
    ({"moe_flex_dispatcher_backend": "ncclep"},
     "--moe-fp4-dispatch through the flex dispatcher serves its DeepEP backend only (got "
     "--moe-flex-dispatcher-backend ncclep)."),
    ({"moe_fp4_dispatch_grad": "fp8"},
     "--moe-fp4-dispatch-grad fp8 is not served through the flex dispatcher: DeepEP's combine, which carries the "
     "dispatch's gradient back, is BF16 only; use --moe-fp4-dispatch-grad bf16."),
    ({"moe_fp4_telemetry": True},
     "--moe-fp4-telemetry is not served through the flex dispatcher yet (its byte counts are the alltoall "
     "dispatcher's rows): drop --moe-fp4-telemetry or use --moe-token-dispatcher-type alltoall."),
    ({"moe_router_padding_for_quantization": True},
     "--moe-fp4-dispatch through the flex dispatcher does not pad the experts' token counts as "
     "--moe-router-padding-for-quantization (or --moe-router-padding-for-fp8) asks: drop that flag."),
    ({"moe_router_padding_for_fp8": True},  # the alias Megatron turns into the flag above
     "--moe-fp4-dispatch through the flex dispatcher does not pad the experts' token counts as "
     "--moe-router-padding-for-quantization (or --moe-router-padding-for-fp8) asks: drop that flag."),
    ({"moe_pad_expert_input_to_capacity": True, "moe_expert_capacity_factor": 1.0},
     "--moe-pad-expert-input-to-capacity is not served by the flex dispatcher's DeepEP backend (megatron-core "
     "refuses it there too): drop it or use --moe-token-dispatcher-type alltoall."),
    ({"expert_model_parallel_size": 1},
     "--moe-fp4-dispatch through the flex dispatcher needs --expert-model-parallel-size above 1 (DeepEP exchanges "
     "tokens between ranks; megatron-core asserts it too): use alltoall on one expert rank."),
    ({"bf16": False},
     "--moe-fp4-dispatch through the flex dispatcher needs --bf16: DeepEP's combine, which also carries the "
     "dispatch's gradient back, is BF16 only."),
    ({"bf16": False, "fp16": True},  # the sentence for --fp16 with the dispatch, whatever the dispatcher
     "--moe-fp4-dispatch, --moe-fp4-experts fp8 and --moe-fp4-linears fp8 run on BF16 activations (MXFP4 values "
     "can overflow float16 and the FP8 GEMMs write BF16): use --bf16 instead of --fp16."),
], ids=["hybridep", "ncclep", "grad-fp8", "telemetry", "padding-for-quantization", "padding-for-fp8",
        "pad-to-capacity", "one-expert-rank", "fp32", "fp16"])
def test_fp4_dispatch_through_flex_refuses_what_it_does_not_serve(overrides, sentence):
    for planned in (False, True):  # a launch on this machine, and a plan for another (estimate, --dry-run)
        with pytest.raises(UnsupportedConfiguration) as refused:
            if planned:
                validate(FP4Options.from_args(_flex(**overrides)), ModelSettings.from_args(_flex(**overrides)), None,
                         Route.LAUNCHER)
            else:
                _check(_flex(**overrides))
        assert str(refused.value) == sentence
    # Each is about flex: the alltoall dispatcher serves the same flags (where it serves them at all).
    if "moe_flex_dispatcher_backend" in overrides or "moe_router_padding_for_quantization" in overrides or (
            "moe_router_padding_for_fp8" in overrides or "moe_pad_expert_input_to_capacity" in overrides):
        _check(_config(**overrides))


def test_the_patch_route_sends_the_fp4_dispatch_through_alltoall_only():
    """A patched MoELayer builds our dispatcher for alltoall only: under flex it would run Megatron's."""
    _check(_flex(), route=Route.PLUGIN)
    with pytest.raises(UnsupportedConfiguration, match="patched with `megatron-fp4 patch` sends --moe-fp4-dispatch "
                                                       "through the alltoall dispatcher only"):
        _check(_flex(), route=Route.PATCH)
    _check(_config(), route=Route.PATCH)
    _check(_flex(moe_fp4_dispatch=False), route=Route.PATCH)  # stock flex: nothing of ours there


def test_fp8_experts_with_flex_need_the_fp4_dispatch():
    fp8_flex = dict(moe_token_dispatcher_type="flex", bf16=True, expert_model_parallel_size=2)
    _check(_fp8_experts(**fp8_flex))  # fed from the payload the FP4 flex dispatcher received
    with pytest.raises(UnsupportedConfiguration, match="add --moe-fp4-dispatch, whose flex dispatcher feeds them"):
        _check(_fp8_experts(**fp8_flex, moe_fp4_dispatch=False))


def test_options_are_typed_and_built_alike_from_args_and_config():
    args = _parse(["--moe-fp4-dispatch", "--moe-fp4-dispatch-grad", "fp8", "--moe-fp4-scale-rule", "floor",
                   "--moe-fp4-experts", "fp8"])
    options = FP4Options.from_args(args)
    assert options == FP4Options(dispatch=True, dispatch_grad=GradFormat.FP8, scale_rule=ScaleRule.FLOOR,
                                 experts=ExpertsPrecision.FP8)
    assert isinstance(options.dispatch_grad, GradFormat) and isinstance(options.experts, ExpertsPrecision)
    assert FP4Options.from_args(_parse([])) == FP4Options() and not FP4Options().active
    # The patch route copies the moe_fp4_* arguments onto the TransformerConfig: same reading.
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=4, num_moe_experts=8)
    for name, value in vars(args).items():
        setattr(config, name, value)
    assert FP4Options.from_config(config) == options
    with pytest.raises(ValueError):
        FP4Options(scale_rule="nearest")
    with pytest.raises(ValueError):
        FP4Options(dispatch_grad="fp16")


def test_model_settings_read_alike_from_args_and_config():
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=4, num_moe_experts=8,
                               moe_ffn_hidden_size=384, gated_linear_unit=True, activation_func=F.silu,
                               add_bias_linear=False, moe_token_dispatcher_type="alltoall",
                               recompute_granularity="selective", recompute_modules=["moe"])
    args = SimpleNamespace(num_experts=8, hidden_size=256, moe_ffn_hidden_size=384, swiglu=True,
                           add_bias_linear=False, moe_token_dispatcher_type="alltoall",
                           recompute_granularity="selective", recompute_modules=["moe"])
    from_config, from_args = ModelSettings.from_config(config), ModelSettings.from_args(args)
    for name in ("num_experts", "hidden_size", "dispatched_width", "moe_ffn_hidden_size", "swiglu",
                 "add_bias_linear", "dispatcher_type", "moe_recompute", "cuda_graph_captures_moe", "bf16",
                 "flex_backend", "router_padding_for_quantization"):
        assert getattr(from_config, name) == getattr(from_args, name), name
    assert from_config.swiglu and from_config.moe_recompute and from_config.flex_backend is None
    # The flex dispatcher's backend as megatron-core's TransformerConfig resolves it.
    import torch

    for flags, backend in (({"moe_enable_deepep": True}, "deepep"), ({}, "deepep"),
                           ({"moe_flex_dispatcher_backend": "ncclep"}, "ncclep"),
                           ({"moe_flex_dispatcher_backend": "hybridep"}, "hybridep")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # moe_enable_deepep is deprecated
            config = TransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=4, num_moe_experts=8,
                                       moe_token_dispatcher_type="flex", bf16=True, params_dtype=torch.bfloat16,
                                       **flags)
        args = SimpleNamespace(num_experts=8, hidden_size=256, moe_token_dispatcher_type="flex", bf16=True, **flags)
        from_config, from_args = ModelSettings.from_config(config), ModelSettings.from_args(args)
        assert from_config.flex_backend == from_args.flex_backend == backend, flags
        assert from_config.bf16 and from_args.bf16


def test_the_patch_route_refuses_what_needs_the_plugins_layer():
    """A patched tree keeps Megatron's MoELayer: the cache, the saved-input hooks, the FP8 experts and
    the telemetry need ours, so they are refused at start-up there (not at the first forward, not
    ignored)."""
    recompute = dict(recompute_granularity="selective", recompute_modules=["moe"])
    for flags in ({"moe_fp4_cache": True, **recompute}, {"moe_fp4_saved_input": True},
                  {"moe_fp4_experts": "fp8", "swiglu": True, "moe_ffn_hidden_size": 2048},
                  {"moe_fp4_experts": "fp8", "swiglu": True, "moe_ffn_hidden_size": 2048, "moe_fp4_dispatch": False},
                  {"moe_fp4_telemetry": True}):
        _check(_config(**flags), route=Route.LAUNCHER)
        with pytest.raises(UnsupportedConfiguration, match="patched with `megatron-fp4 patch`"):
            _check(_config(**flags), route=Route.PATCH)
    _check(_config(), route=Route.PATCH)


def test_fp8_experts_serve_the_allgather_dispatcher_too():
    _check(_fp8_experts(moe_fp4_dispatch=False, moe_token_dispatcher_type="allgather"))


def test_fp8_experts_need_hopper():
    with pytest.raises(UnsupportedConfiguration, match=r"Hopper GPUs \(compute capability 9.0, found \(10, 0\)\)"):
        _check(_fp8_experts(), capability=(10, 0))
    _check(_config(), capability=(10, 0))  # the dispatch's Triton kernels are not SM90-specific


def test_fp8_experts_need_the_fully_reshardable_optimizer_checkpoints():
    fp8 = _fp8_experts(use_distributed_optimizer=True, save="/ckpt")
    with pytest.raises(UnsupportedConfiguration, match="--dist-ckpt-optim-fully-reshardable"):
        _check(fp8)
    with pytest.raises(UnsupportedConfiguration, match="--dist-ckpt-optim-fully-reshardable"):
        _check(_fp8_experts(use_layer_wise_distributed_optimizer=True, load="/ckpt"))
    _check(_fp8_experts(use_distributed_optimizer=True, save="/ckpt", dist_ckpt_optim_fully_reshardable=True))
    _check(_fp8_experts(use_distributed_optimizer=True))  # nothing saved or loaded
    _check(_config(use_distributed_optimizer=True, load="/ckpt"))  # stock experts: Megatron's own business


def test_planning_for_another_machine_skips_this_machines_checks():
    """The estimator and --dry-run validate without a GPU and against no megatron-core version."""
    validate(FP4Options(dispatch=True), ModelSettings.from_args(_config()), None, Route.LAUNCHER)
    with pytest.raises(UnsupportedConfiguration, match="alltoall"):
        validate(FP4Options(dispatch=True), ModelSettings.from_args(_config(moe_token_dispatcher_type="allgather")),
                 None, Route.LAUNCHER)


def test_kept_transposed_weights_need_fp8_weight_copies():
    with pytest.raises(UnsupportedConfiguration, match="--moe-fp4-keep-transposed-weights needs --moe-fp4-experts fp8"):
        _check(_config(moe_fp4_keep_transposed_weights=True))
    _check(_fp8_experts(moe_fp4_keep_transposed_weights=True))


def test_every_refusal_is_one_sentence_naming_a_flag():
    from megatron_fp4.options import REFUSALS

    for refusal in REFUSALS:
        text = refusal.message
        assert text.endswith(".") and text.count(". ") == 0, text
        assert "--" in text, text


def test_usage_doc_carries_the_generated_tables():
    """docs/usage.md holds exactly the tables `python -m megatron_fp4.options` prints."""
    from pathlib import Path

    from megatron_fp4.options import usage_markdown

    usage = (Path(__file__).resolve().parents[2] / "docs" / "usage.md").read_text()
    assert usage_markdown() in usage, "docs/usage.md is stale: regenerate with `python -m megatron_fp4.options`"


def _fused_attention(**overrides):
    base = dict(moe_fp4_fused_attention=True, moe_fp4_dispatch=False, transformer_impl="local",
                attention_dropout=0.0)
    base.update(overrides)
    return _config(**base)


def test_fused_attention_flag_parses_touches_the_model_and_serves_dense_models():
    assert _parse(["--moe-fp4-fused-attention"]).moe_fp4_fused_attention and not _parse([]).moe_fp4_fused_attention
    options = FP4Options.from_args(_parse(["--moe-fp4-fused-attention"]))
    assert options == FP4Options(fused_attention=True) and options.active and not options.touches_moe_layers
    _check(_fused_attention())
    # The attention alone builds no part of the MoE layers: a dense model, any hidden size, is served.
    _check(_fused_attention(num_experts=None, hidden_size=4000))
    with pytest.raises(UnsupportedConfiguration, match="--moe-fp4-recompute-experts need CUDA GPUs"):
        _check(_fused_attention(), cuda=False)
    with pytest.raises(UnsupportedConfiguration, match="supports megatron-core 0.18 to 0.19"):
        _check(_fused_attention(), version="0.17.1")


@pytest.mark.parametrize("overrides, route, message", [
    ({"transformer_impl": "transformer_engine"}, Route.LAUNCHER, "--transformer-impl local"),
    ({"context_parallel_size": 2}, Route.PLUGIN, "--context-parallel-size 1 \\(got 2\\)"),
    ({"attention_dropout": 0.1}, Route.LAUNCHER, "--attention-dropout 0 \\(got 0.1"),
    ({"reset_attention_mask": True}, Route.LAUNCHER, "--reset-attention-mask"),
    ({}, Route.PATCH, "patched with `megatron-fp4 patch`"),
])
def test_fused_attention_refusals(overrides, route, message):
    with pytest.raises(UnsupportedConfiguration, match=message):
        _check(_fused_attention(**overrides), route=route)


def _fp8_linears(**overrides):
    settings = dict(moe_fp4_dispatch=False, moe_fp4_linears="fp8", transformer_impl="local", add_bias_linear=False,
                    tensor_model_parallel_size=1)
    return _config(**{**settings, **overrides})


def test_bf16_linears_flag_parses_and_needs_fp8_linears_with_a_role_left():
    args = _parse(["--moe-fp4-linears", "fp8", "--moe-fp4-bf16-linears", "attention", "mlp"])
    assert FP4Options.from_args(args).bf16_linears == {LinearRole.ATTENTION, LinearRole.DENSE_MLP}
    assert _parse([]).moe_fp4_bf16_linears == [] and FP4Options().bf16_linears == frozenset()
    with pytest.raises(SystemExit):
        _parse(["--moe-fp4-bf16-linears", "experts"])
    options = FP4Options(linears="fp8", bf16_linears=["attention"])
    assert not options.fp8_linear(LinearRole.ATTENTION) and options.fp8_linear(LinearRole.DENSE_MLP)
    assert not FP4Options(bf16_linears=["mlp"]).fp8_linear(LinearRole.ATTENTION)
    _check(_fp8_linears(moe_fp4_bf16_linears=["attention"], moe_shared_expert_intermediate_size=1024))
    with pytest.raises(UnsupportedConfiguration, match="add --moe-fp4-linears fp8"):
        _check(_fp8_linears(moe_fp4_linears="bf16", moe_fp4_bf16_linears=["attention"]))
    with pytest.raises(UnsupportedConfiguration, match="names every role"):
        _check(_fp8_linears(moe_fp4_bf16_linears=[r.value for r in LinearRole]))


@pytest.mark.parametrize("model, bf16_roles, refused", [
    # Every layer MoE, no shared experts, standard attention: the attention projections are all there is.
    ({}, ["attention"], True),
    ({}, ["mlp", "shared_experts", "mla_up_proj"], False),
    ({"moe_layer_freq": [0, 1, 1]}, ["attention"], False),  # a dense first layer
    ({"moe_layer_freq": [0, 1, 1]}, ["attention", "mlp"], True),
    ({"moe_layer_freq": 2}, ["attention", "mlp"], True),
    ({"moe_layer_freq": "([0]+[1]*2)"}, ["attention"], False),  # not parsed here: possibly dense
    ({"moe_shared_expert_intermediate_size": 1024}, ["attention"], False),
    ({"multi_latent_attention": True}, ["attention"], False),
    ({"multi_latent_attention": True, "num_experts": None}, ["attention", "mla_up_proj"], False),  # dense model
    ({"multi_latent_attention": True, "num_experts": None, "moe_fp4_dispatch": False},
     ["attention", "mla_up_proj", "mlp"], True),
])
def test_bf16_linears_refused_when_they_leave_the_model_no_fp8_linear(model, bf16_roles, refused):
    config = _fp8_linears(moe_fp4_bf16_linears=bf16_roles, **model)
    if refused:
        with pytest.raises(UnsupportedConfiguration, match="names every role this model"):
            _check(config)
    else:
        _check(config)


def test_linears_grad_flag_parses_and_needs_fp8_linears():
    assert FP4Options.from_args(_parse([])).linears_grad is GradFormat.FP8
    args = _parse(["--moe-fp4-linears", "fp8", "--moe-fp4-linears-grad", "bf16"])
    assert FP4Options.from_args(args).linears_grad is GradFormat.BF16
    with pytest.raises(SystemExit):
        _parse(["--moe-fp4-linears-grad", "fp4"])
    _check(_fp8_linears(moe_fp4_linears_grad="bf16"))
    with pytest.raises(UnsupportedConfiguration, match="add --moe-fp4-linears fp8"):
        _check(_fp8_linears(moe_fp4_linears="bf16", moe_fp4_linears_grad="bf16"))


FP16_REFUSAL = "use --bf16 instead of --fp16"


@pytest.mark.parametrize("flags", [
    {},  # the MXFP4 dispatch (the all-to-all refuses float16 tokens at the first forward)
    {"moe_fp4_cache": True, "recompute_granularity": "selective", "recompute_modules": ["moe"]},
    {"moe_fp4_telemetry": True},
    {"moe_fp4_saved_input": True},
    {"moe_fp4_experts": "fp8", "swiglu": True, "moe_ffn_hidden_size": 2048},
    {"moe_fp4_experts": "fp8", "swiglu": True, "moe_ffn_hidden_size": 2048, "moe_fp4_dispatch": False},
    {"moe_fp4_dispatch": False, "moe_fp4_linears": "fp8", "transformer_impl": "local"},
], ids=["dispatch", "cache", "telemetry", "saved-input", "fp8-experts", "fp8-experts-bf16-dispatch", "fp8-linears"])
def test_fp16_is_refused_at_start_up_with_the_flags_that_run_on_bf16(flags):
    """--fp16 passed the dry run and the estimate, then stopped at the first MoE forward (the
    dispatch takes BF16 or fp32 tokens; the experts' SM90 GEMMs write BF16 or fp32): now every
    route refuses it before anything runs, the plugin's config reading included."""
    from megatron.core.transformer import TransformerConfig

    _check(_config(**flags))  # with BF16 (or fp32) activations it passes
    with pytest.raises(UnsupportedConfiguration, match=FP16_REFUSAL):
        _check(_config(**flags, fp16=True))
    with pytest.raises(UnsupportedConfiguration, match=FP16_REFUSAL):
        validate(FP4Options.from_args(_config(**flags)), ModelSettings.from_args(_config(**flags, fp16=True)), None,
                 Route.LAUNCHER)  # --dry-run and the estimator: no machine
    config = TransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=4, fp16=True)
    assert ModelSettings.from_config(config).fp16
    assert not ModelSettings.from_config(TransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=4,
                                                           bf16=True)).fp16


def test_fp16_serves_the_flags_that_do_not_need_bf16():
    _check(_config(moe_fp4_dispatch=False, fp16=True))  # nothing of ours: stock Megatron
    _check(_fused_attention(fp16=True))  # torch's fused attention takes float16


def test_the_moe_layer_recompute_alias_is_selective_moe_recompute():
    """Megatron's deprecated --moe-layer-recompute is `--recompute-granularity selective
    --recompute-modules moe` added to the modules (core_attn when none are given), which its
    TransformerConfig resolves; the arguments still hold the alias, so the refusals resolve it too."""
    from megatron.core.transformer import TransformerConfig

    cache = dict(moe_fp4_cache=True)
    _check(_config(**cache, recompute_granularity="selective", recompute_modules=["moe"]))
    _check(_config(**cache, moe_layer_recompute=True))  # refused as "without whole-layer MoE recompute" before
    _check(_config(**cache, moe_layer_recompute=True, recompute_granularity="selective",
                   recompute_modules=["core_attn"]))
    alias = ModelSettings.from_args(_config(moe_layer_recompute=True))
    explicit = ModelSettings.from_args(_config(recompute_granularity="selective",
                                               recompute_modules=["core_attn", "moe"]))
    assert alias == explicit and alias.moe_recompute
    assert ModelSettings.from_args(_config(moe_layer_recompute=True, recompute_modules=["mlp"])).recompute_modules \
        == ("mlp", "moe")
    # Megatron's own resolution, on the plugin and patch routes' config: the same settings.
    config = TransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=4, moe_layer_recompute=True)
    assert (config.recompute_granularity, config.recompute_modules) == ("selective", ["core_attn", "moe"])
    assert ModelSettings.from_config(config).moe_recompute
    assert ModelSettings.from_config(config).recompute_modules == alias.recompute_modules
    # With full recompute Megatron refuses the alias; it is no `moe` recompute for the cache either.
    with pytest.raises(UnsupportedConfiguration, match="--moe-fp4-cache serves only the recompute of whole MoE"):
        _check(_config(**cache, moe_layer_recompute=True, recompute_granularity="full"))
    with pytest.raises(UnsupportedConfiguration, match="drop moe_act"):  # an alias keeps the other modules' rules
        _check(_fp8_experts(moe_layer_recompute=True, recompute_modules=["moe_act"]))


@pytest.mark.parametrize("modules", [["expert_fc1"], ["moe_act"], ["core_attn", "expert_fc1", "moe_act"],
                                     ["fused_group_mlp"]])
def test_fp8_experts_refuse_offloading_their_activations(modules):
    """Megatron offloads expert_fc1 / moe_act / fused_group_mlp only inside TEGroupedMLP, which our FP8
    experts replace: accepted, they did nothing."""
    offload = dict(fine_grained_activation_offloading=True, offload_modules=modules)
    with pytest.raises(UnsupportedConfiguration, match="drop expert_fc1, moe_act and fused_group_mlp from "
                                                       "--offload-modules"):
        _check(_fp8_experts(**offload))
    with pytest.raises(UnsupportedConfiguration, match="--offload-modules"):
        _check(_fp8_experts(**offload, moe_fp4_dispatch=False))
    _check(_config(**offload))  # Megatron's own experts behind the FP4 dispatch: its business
    _check(_fp8_experts(offload_modules=modules))  # listed, but offloading is off


def test_fp8_experts_serve_offloading_outside_the_experts():
    _check(_fp8_experts(fine_grained_activation_offloading=True, offload_modules=["core_attn", "attn_proj",
                                                                                  "attn_norm", "mlp_norm"]))


def test_recompute_experts_flag_parses_and_serves_every_experts_precision():
    assert not _parse([]).moe_fp4_recompute_experts and _parse(["--moe-fp4-recompute-experts"]).moe_fp4_recompute_experts
    options = FP4Options.from_args(_parse(["--moe-fp4-recompute-experts"]))
    assert options == FP4Options(recompute_experts=True) and options.active and not options.touches_moe_layers
    selective = {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "layernorm"]}
    _check(_config(moe_fp4_dispatch=False, moe_fp4_recompute_experts=True, **selective))  # Megatron's BF16 experts
    _check(_config(moe_fp4_recompute_experts=True))  # the FP4 dispatch into Megatron's experts
    _check(_fp8_experts(moe_fp4_recompute_experts=True, **selective))  # from the payload
    _check(_fp8_experts(moe_fp4_dispatch=False, moe_fp4_recompute_experts=True))  # the FP8 baseline


@pytest.mark.parametrize("overrides, message", [
    ({"recompute_granularity": "selective", "recompute_modules": ["moe"]}, "recompute already"),
    ({"recompute_granularity": "selective", "recompute_modules": ["layernorm", "moe_act"]}, "recompute already"),
    ({"moe_layer_recompute": True}, "recompute already"),  # Megatron's alias of `moe`
    ({"recompute_granularity": "full"}, "recompute already"),
    ({"fp8": "e4m3"}, "Transformer Engine's FP8"),
    ({"moe_fp4_saved_input": True}, "drop one of the two flags"),
    ({"num_experts": None, "moe_fp4_dispatch": False}, "needs an MoE model"),
    ({"delay_wgrad_compute": True}, "cannot delay their weight gradients"),
    ({"overlap_moe_expert_parallel_comm": True, "moe_fp4_dispatch": False}, "--overlap-moe-expert-parallel-comm"),
    ({"fine_grained_activation_offloading": True, "offload_modules": ["expert_fc1"]}, "offload their activations"),
])
def test_recompute_experts_refusals(overrides, message):
    with pytest.raises(UnsupportedConfiguration, match=message):
        _check(_config(moe_fp4_recompute_experts=True, **overrides))


def test_the_patch_route_refuses_recompute_experts():
    with pytest.raises(UnsupportedConfiguration, match="--moe-fp4-recompute-experts"):
        _check(_config(moe_fp4_recompute_experts=True), route=Route.PATCH)


@pytest.mark.parametrize("overrides, message", [
    ({"fp4": "e2m1"}, "Transformer Engine's FP8 or FP4"),
    ({"overlap_dispatch_backward_with_experts_wgrad": True, "moe_fp4_dispatch": False}, "cannot delay"),
    ({"moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "ncclep", "moe_fp4_dispatch": False},
     "DeepEP only"),
    ({"moe_fp4_dispatch": False}, "Megatron's activation checkpoint run only there"),
])
def test_recompute_experts_refusals_of_the_review(overrides, message):
    cuda = "only there" not in message
    with pytest.raises(UnsupportedConfiguration, match=message):
        _check(_config(moe_fp4_recompute_experts=True, **overrides), cuda=cuda)
