"""Megatron-LM 0.19's pretrain_gpt.py: the model is built inside the wheel from a GPTModelConfig.

Its main turns the arguments into a `GPTModelConfig` (`gpt_config_from_args`) and hands it to
`pretrain`, which builds every model chunk with the builder the config names
(`GPTModelConfig.builder`, a class path). `gpt_model_config(model_cfg)` makes that config build
our layers:

- its `transformer_layer_spec` (None for Megatron's default, a ModuleSpec, or a callable of the
  config) becomes `FP4LayerSpec`, a callable that builds the same spec and applies `use_fp4`;
- its builder becomes `FP4GPTModelBuilder`, Megatron's GPTModelBuilder whose `build_model` also
  applies `use_fp4` to the MTP block spec. Megatron's builder derives that spec from the decoder's
  stock layer specs (`megatron.training.models.gpt.mtp_block_spec`), not from the config's spec,
  so for the duration of our builder's own `build_model` call that one module function returns
  its spec through `use_fp4`; it is restored when the call returns. No file of Megatron changes.
"""

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any

from megatron.core.transformer.spec_utils import ModuleSpec

from ..integration import use_fp4
from ..options import FP4Options, UnsupportedConfiguration
from .refusal import refuse

BUILDER = f"{__name__}.FP4GPTModelBuilder"


def _gpt_module():
    try:
        import megatron.training.models.gpt as gpt
    except ImportError as err:
        raise UnsupportedConfiguration(
            f"megatron_fp4.launch.gpt_model_config needs megatron-core 0.19's GPTModelConfig ({err}); with 0.18, "
            "apply the spec lines in gpt_builders.py (docs/integration.md).") from None
    return gpt


@dataclass(frozen=True)
class FP4LayerSpec:
    """The decoder spec a GPTModelConfig held (None, a ModuleSpec or a callable of the config and
    vp_stage), built as Megatron's builder would and then swapped by `use_fp4`."""

    options: FP4Options
    original: Any = None

    def __call__(self, config, vp_stage=None):
        spec = self.original
        if spec is None:
            spec = _gpt_module().default_layer_spec(config, vp_stage)
        elif not isinstance(spec, ModuleSpec) and callable(spec):
            takes_stage = "vp_stage" in inspect.signature(spec).parameters
            spec = spec(config, vp_stage=vp_stage) if takes_stage else spec(config)
        return use_fp4(spec, self.options)


def gpt_model_config(model_config, args=None):
    """`model_config` (the GPTModelConfig of Megatron-LM 0.19's pretrain_gpt.py) building MoE, MTP
    and linear layers as our flags ask (`args`: default Megatron's parsed arguments). Changes and
    returns the same object (unchanged without any of our flags); a config it cannot serve stops
    the run (one sentence, exit status 2), at this call or when the model is built."""
    try:
        return _fp4_model_config(model_config, args)
    except UnsupportedConfiguration as err:
        refuse(str(err))


def _fp4_model_config(model_config, args):
    gpt = _gpt_module()
    if args is None:
        from megatron.training import get_args
        args = get_args()
    options = FP4Options.from_args(args)
    if not options.active:  # no flag of ours: Megatron's config as it was
        return model_config
    if model_config.builder not in (gpt.GPTModelConfig.builder, BUILDER):
        raise UnsupportedConfiguration(
            f"megatron_fp4 builds the model with Megatron's GPTModelBuilder, and this model config names "
            f"{model_config.builder} (e.g. ModelOpt's): drop that option or megatron_fp4's flags.")
    spec = model_config.transformer_layer_spec
    if isinstance(spec, FP4LayerSpec):
        spec = spec.original
    model_config.transformer_layer_spec = FP4LayerSpec(options, spec)
    model_config.builder = BUILDER  # an instance value, as Megatron's own from_dict sets it
    return model_config


@contextlib.contextmanager
def _mtp_specs_through(gpt, options: FP4Options):
    stock = gpt.mtp_block_spec

    def mtp_block_spec(*args, **kwargs):
        return use_fp4(stock(*args, **kwargs), options)

    gpt.mtp_block_spec = mtp_block_spec
    try:
        yield
    finally:
        gpt.mtp_block_spec = stock


def _builder_class():
    gpt = _gpt_module()

    class FP4GPTModelBuilder(gpt.GPTModelBuilder):
        """Megatron's GPTModelBuilder; the MTP block spec also goes through use_fp4."""

        def build_model(self, *args, **kwargs):
            spec = self._model_config.transformer_layer_spec
            if not isinstance(spec, FP4LayerSpec):
                refuse(
                    "FP4GPTModelBuilder builds a model config prepared by megatron_fp4.launch.gpt_model_config, "
                    "and this one's transformer_layer_spec was replaced after it: call gpt_model_config last.")
            try:
                with _mtp_specs_through(gpt, spec.options):
                    return super().build_model(*args, **kwargs)
            except UnsupportedConfiguration as err:  # a refusal of the spec swap (e.g. Transformer Engine layers)
                refuse(str(err))

    FP4GPTModelBuilder.__module__ = __name__
    return FP4GPTModelBuilder


def __getattr__(name):
    # Defined on first use: megatron-core 0.18 has no GPTModelBuilder to derive from.
    if name == "FP4GPTModelBuilder":
        builder = _builder_class()
        globals()[name] = builder
        return builder
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
