"""megatron_fp4.launch.gpt_model_config (Megatron-LM 0.19's model-config line) in process, on
CPU: the decoder spec it hands Megatron's builder, what it refuses, and that the MTP spec function
it wraps during our builder's build_model is Megatron's own again afterwards. The end-to-end runs
are tests/launch/test_user_pretrain_gpt.py's."""

from types import SimpleNamespace

import megatron.training.models.gpt as megatron_gpt
import pytest
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_fp4.integration import FP4MoELayer
from megatron_fp4.launch import model_config
from megatron_fp4.options import FP4Options, UnsupportedConfiguration

ARGS = SimpleNamespace(moe_fp4_dispatch=True)


def _model_config(spec=None):
    transformer = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=2, num_moe_experts=4,
                                    transformer_impl="local")
    return megatron_gpt.GPTModelConfig(transformer=transformer, transformer_layer_spec=spec, vocab_size=128)


def _moe_layer_spec(*args, **kwargs):
    return get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)


@pytest.mark.parametrize("original", [None, _moe_layer_spec(), _moe_layer_spec,
                                      lambda config, vp_stage=None: _moe_layer_spec()],
                         ids=["default", "module-spec", "callable", "callable-with-vp-stage"])
def test_the_config_builds_fp4_moe_layers_with_our_builder(original, one_rank):
    config = model_config.gpt_model_config(_model_config(original), ARGS)
    assert config.get_builder_cls() is model_config.FP4GPTModelBuilder
    assert issubclass(config.get_builder_cls(), megatron_gpt.GPTModelBuilder)
    spec = config.transformer_layer_spec(config, vp_stage=None)
    layers = getattr(spec, "layer_specs", [spec])  # Megatron's default for MoE is a block spec
    assert layers and all(layer.submodules.mlp.func is FP4MoELayer for layer in layers)
    assert config.transformer_layer_spec.options == FP4Options(dispatch=True)
    if original is not None and not callable(original):
        assert original.submodules.mlp.func is not FP4MoELayer  # the user's spec is left as it was
    again = model_config.gpt_model_config(config, ARGS)  # a second call wraps the original, not ours
    assert again.transformer_layer_spec.original is original


def test_another_builder_is_refused(capsys):
    config = _model_config()
    config.builder = "megatron.post_training.model_builder.ModelOptGPTModelBuilder"
    with pytest.raises(SystemExit) as stop:
        model_config.gpt_model_config(config, ARGS)
    assert stop.value.code == 2
    assert capsys.readouterr().err == (
        "error: megatron_fp4 builds the model with Megatron's GPTModelBuilder, and this model config names "
        "megatron.post_training.model_builder.ModelOptGPTModelBuilder (e.g. ModelOpt's): drop that option or "
        "megatron_fp4's flags.\n")


def test_a_spec_replaced_after_the_line_is_refused(capsys):
    config = model_config.gpt_model_config(_model_config(), ARGS)
    config.transformer_layer_spec = _moe_layer_spec()
    with pytest.raises(SystemExit) as stop:
        config.get_builder_cls()(config).build_model(pg_collection=None)
    assert stop.value.code == 2 and "call gpt_model_config last" in capsys.readouterr().err


def test_the_mtp_spec_function_is_megatrons_again_after_a_build(monkeypatch):
    stock = megatron_gpt.mtp_block_spec
    seen = {}

    def build_model(self, *args, **kwargs):  # Megatron's, reduced to the MTP spec call
        seen["mtp"] = megatron_gpt.mtp_block_spec(self._model_config, None)
        raise RuntimeError("stop after the MTP spec")

    monkeypatch.setattr(megatron_gpt.GPTModelBuilder, "build_model", build_model)
    monkeypatch.setattr(megatron_gpt, "mtp_block_spec", lambda config, spec, vp_stage=None: _moe_layer_spec())
    wrapped = megatron_gpt.mtp_block_spec
    config = model_config.gpt_model_config(_model_config(), ARGS)
    with pytest.raises(RuntimeError, match="stop after the MTP spec"):
        config.get_builder_cls()(config).build_model(pg_collection=None)
    assert seen["mtp"].submodules.mlp.func is FP4MoELayer
    assert megatron_gpt.mtp_block_spec is wrapped  # restored although build_model raised
    monkeypatch.undo()
    assert megatron_gpt.mtp_block_spec is stock


def test_without_our_flags_the_config_is_megatrons():
    config = model_config.gpt_model_config(_model_config(), SimpleNamespace())
    assert config.builder == megatron_gpt.GPTModelConfig.builder and config.transformer_layer_spec is None


def test_a_refusal_while_the_model_is_built_is_one_sentence(monkeypatch, capsys):
    def refusing(spec, options):
        raise UnsupportedConfiguration("--moe-fp4-linears fp8 serves Megatron's local MLP only.")

    def build_model(self, *args, **kwargs):  # Megatron's, reduced to the spec call
        return self._model_config.transformer_layer_spec(self._model_config, vp_stage=None)

    monkeypatch.setattr(model_config, "use_fp4", refusing)
    monkeypatch.setattr(megatron_gpt.GPTModelBuilder, "build_model", build_model)
    config = model_config.gpt_model_config(_model_config(_moe_layer_spec()), ARGS)
    with pytest.raises(SystemExit) as stop:
        config.get_builder_cls()(config).build_model(pg_collection=None)
    assert stop.value.code == 2
    assert capsys.readouterr().err == "error: --moe-fp4-linears fp8 serves Megatron's local MLP only.\n"
