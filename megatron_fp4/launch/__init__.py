"""Training with megatron_fp4: our launcher, and the three lines a Megatron-LM pretrain_gpt.py needs.

Our launcher (`torchrun ... -m megatron_fp4.launch` or `scripts/pretrain_gpt_fp4.py`, with
Megatron's flags and ours) is `pretrain.main`: Megatron's parser plus our flags and the defaults
this machine needs (`arguments`), our validation before and after Megatron's (`refusal`: one
sentence, exit status 2), the optional memory cap (`memory_cap`), the fixes stock megatron-core 0.19.2 needs
(`workarounds`), and the GPT model, data and loss (`gpt`). `torchrun` starts it from a YAML run
config on one node or many (`scripts/launch.py`). Context parallelism is refused there
(batches are not sliced per CP rank), and Megatron's --yaml-cfg is not supported (it replaces every
flag, ours included).

Your own Megatron-LM pretrain_gpt.py needs three lines:

    import megatron_fp4.launch as fp4
    args = fp4.parse_and_validate_args(...)  # was Megatron's parse_and_validate_args(...), same arguments
    transformer_layer_spec = fp4.layer_spec(transformer_layer_spec)  # where the layer spec is built

The second line adds our flags to Megatron's parser (before the script's own extra_args_provider)
and refuses what the plugin cannot serve with one sentence and exit status 2, before Megatron's
validation prints its argument dump (and again after that validation). The third swaps the MoE layers (and their experts) of the spec as the flags ask; put
it before the MTP block spec is built from the layer spec, so that MTP layers follow. In Megatron-LM
checkouts that build the spec in gpt_builders.py rather than in pretrain_gpt.py, the third line (with
the import) goes there. tests/launch/test_user_pretrain_gpt.py applies them to a stand-in of
pretrain_gpt.py.
"""

import importlib

# Imported on first use: `torchrun` (the YAML launcher) only spawns the training processes and
# should not pay for Megatron's model and training modules.
_EXPORTS = {"add_arguments": "arguments", "parse_and_validate_args": "arguments", "layer_spec": "gpt",
            "main": "pretrain"}


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)


__all__ = sorted(_EXPORTS)
