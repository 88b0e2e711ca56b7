"""Our flags on Megatron's parser, the launcher's changed defaults, and parse + validate."""

import argparse

from megatron.training.arguments import parse_and_validate_args as megatron_parse_and_validate_args
from megatron.training.arguments import parse_args as megatron_parse_args

from .. import options
from ..options import Route, before_megatron_validation
from ..run_config import GPU_MEMORY_CAP_ENV
from .census_watch import watch as watch_the_model
from .installed import HAVE_APEX, HAVE_APEX_GRAD_ACCUM, HAVE_FUSED_SOFTMAX, HAVE_TE
from .refusal import check_args
from .telemetry_log import install as install_telemetry_log
from .workarounds import (NO_EVALUATION_INTERVAL, escape_percent_in_help,
                          recompute_without_output_without_transformer_engine, use_prebuilt_dataset_helpers)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron's extra_args_provider for any training script: our flags (group megatron_fp4)."""
    escape_percent_in_help(parser)
    return options.add_arguments(parser)


def defaults_for_this_machine() -> dict:
    """Megatron defaults that name kernels not installed here (Transformer Engine, apex and its
    fused softmax are not in the wheel), turned off so that a plain install runs; explicit flags
    still win."""
    changed = {}
    if not HAVE_TE:
        changed.update(transformer_impl="local", apply_rope_fusion=False)
        if not HAVE_APEX_GRAD_ACCUM:
            changed.update(gradient_accumulation_fusion=False)
    if not HAVE_APEX:
        changed.update(no_persist_layer_norm=True)
    if not HAVE_FUSED_SOFTMAX:
        changed.update(masked_softmax_fusion=False)
    return changed


def add_launcher_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Our launcher's extra_args_provider: our flags, defaults that fit this machine, and --help's
    closing note on both."""
    changed = defaults_for_this_machine()
    note = (f"Environment: {GPU_MEMORY_CAP_ENV}=N caps this process's CUDA memory (PyTorch's caching "
            "allocator) at N GiB before the first allocation; past it, torch.OutOfMemoryError.")
    if changed:
        parser.set_defaults(**changed)
        note += (" Defaults changed by this launcher because Transformer Engine / apex kernels are not "
                 "installed here: " + ", ".join(f"{k}={v}" for k, v in changed.items()) + ".")
    parser.epilog = note
    return add_arguments(parser)


LAUNCHER_DEFAULTS = {"eval_interval": NO_EVALUATION_INTERVAL}


def check_before_megatron_validates(extra_args_provider, ignore_unknown_args: bool, args_defaults: dict,
                                    route: Route) -> None:
    """Our validation on the command line as parsed, before Megatron validates it: a refusal then
    stops the run before Megatron prints its argument dump (hundreds of lines), so that its
    sentence is all the run says. Megatron's parser runs again for its own validation, after which
    ours runs once more on the validated arguments."""
    args = megatron_parse_args(extra_args_provider, ignore_unknown_args)
    check_args(before_megatron_validation(args, args_defaults), route)


def parse_launcher_args() -> argparse.Namespace:
    """Megatron's parse + validate for our launcher (which also sets Megatron's globals: args,
    tokenizer, timers); our own validation is main()'s, before and after this."""
    return megatron_parse_and_validate_args(add_launcher_arguments, args_defaults=LAUNCHER_DEFAULTS)


def _chain(first, then):
    if then is None:
        return first
    return lambda parser: then(first(parser))


def parse_and_validate_args(extra_args_provider=None, ignore_unknown_args=False, args_defaults=None,
                            route: Route = Route.PLUGIN) -> argparse.Namespace:
    """Megatron's parse_and_validate_args (same arguments) with our flags added, then our
    validation: a configuration the plugin refuses stops the run with one sentence and exit
    status 2, before Megatron initializes anything on the GPU. The model built from these arguments
    is counted at its first forward pass (census_watch): one line says what runs FP4, and a model
    without our layers where the flags ask for them is refused. With --moe-fp4-telemetry, Megatron's
    training log reports the telemetry (telemetry_log). Without Transformer Engine, Megatron's
    layernorm recompute gets the fix the launcher applies, and with the megatron-core wheel (no
Makefile for its dataset helpers) Megatron's `make` of them is skipped (workarounds.py)."""
    provider = _chain(add_arguments, extra_args_provider)
    check_before_megatron_validates(provider, ignore_unknown_args, args_defaults or {}, route)
    args = megatron_parse_and_validate_args(provider, ignore_unknown_args, args_defaults or {})
    watch_the_model(check_args(args, route))
    install_telemetry_log(args)
    recompute_without_output_without_transformer_engine()
    use_prebuilt_dataset_helpers()
    return args
