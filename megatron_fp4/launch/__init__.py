"""Training with megatron_fp4: our launcher, and the lines a Megatron-LM training script needs.

Our launcher (`torchrun ... -m megatron_fp4.launch` or `scripts/pretrain_gpt_fp4.py`, with
Megatron's flags and ours) is `pretrain.main`: Megatron's parser plus our flags and the defaults
this machine needs (`arguments`), our validation before and after Megatron's (`refusal`: one
sentence, exit status 2), the optional memory cap (`memory_cap`), the fixes stock megatron-core 0.19.2 needs
(`workarounds`), and the GPT model, data and loss (`gpt`). `torchrun` starts it from a YAML run
config on one node or many (`scripts/launch.py`). Context parallelism is refused there
(batches are not sliced per CP rank), and Megatron's --yaml-cfg is not supported (it replaces every
flag, ours included).

Your own Megatron-LM training script: the lines per release (docs/integration.md says the same).

Megatron-LM 0.19 (tag core_v0.19.0): pretrain_gpt.py builds the model inside the wheel from a
GPTModelConfig; three lines there, MTP layers included:

    import megatron_fp4.launch as fp4
    args = fp4.parse_and_validate_args(...)  # was Megatron's parse_and_validate_args(...), same arguments
    model_cfg = fp4.gpt_model_config(model_cfg)  # after model_cfg = gpt_config_from_args(...)

Megatron-LM 0.18 (tag core_v0.18.0), and any script that builds the model in gpt_builders.py's
gpt_builder: pretrain_gpt.py gets the import and the parse line above; gpt_builders.py gets the
import and, right before `model = GPTModel(`, two lines:

    transformer_layer_spec = fp4.layer_spec(transformer_layer_spec)
    mtp_block_spec = fp4.layer_spec(mtp_block_spec)

The parse line adds our flags to Megatron's parser (before the script's own extra_args_provider)
and refuses what the plugin cannot serve with one sentence and exit status 2, before Megatron's
validation prints its argument dump (and again after that validation). It also has the model
counted at its first forward pass (census_watch): one line says what runs FP4, and a model built
without our layers where the flags ask for them stops with one sentence, exit status 2, so a
missing or misplaced spec line cannot leave FP4 silently off. tests/launch/test_user_pretrain_gpt.py
applies the lines to project-written stand-ins of both releases' scripts (tests/data/).
"""

import importlib

# Imported on first use: `torchrun` (the YAML launcher) only spawns the training processes and
# should not pay for Megatron's model and training modules.
_EXPORTS = {"add_arguments": "arguments", "parse_and_validate_args": "arguments", "layer_spec": "gpt",
            "gpt_model_config": "model_config", "main": "pretrain"}


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)


__all__ = sorted(_EXPORTS)
