"""Our launcher's main: parse, validate, cap memory, then Megatron's pretrain()."""

import warnings

import torch
from megatron.core.enums import ModelType
from megatron.training import pretrain
from megatron.training.argument_utils import pretrain_cfg_container_from_args

from ..options import Route, UnsupportedConfiguration
from .arguments import LAUNCHER_DEFAULTS, add_launcher_arguments, check_before_megatron_validates, parse_launcher_args
from .census_watch import watch as watch_the_model
from .gpt import forward_step, model_provider, train_valid_test_datasets_provider
from .memory_cap import apply_memory_cap
from .refusal import check_args, refuse
from .telemetry_log import install as install_telemetry_log
from .workarounds import (full_validation_of_one_set, recompute_without_output_without_transformer_engine,
                          use_prebuilt_dataset_helpers)


def main():
    check_before_megatron_validates(add_launcher_arguments, False, LAUNCHER_DEFAULTS, Route.LAUNCHER)
    args = parse_launcher_args()
    # right after Megatron's own validation, before any GPU work
    watch_the_model(check_args(args, Route.LAUNCHER))
    install_telemetry_log(args)
    apply_memory_cap(args.local_rank)

    use_prebuilt_dataset_helpers()
    full_validation_of_one_set()
    recompute_without_output_without_transformer_engine()
    with warnings.catch_warnings():  # it recommends a model config; we pass a model provider
        warnings.simplefilter("ignore")
        cfg = pretrain_cfg_container_from_args(args)
    # By keyword: megatron-core 0.18 and 0.19 order these parameters differently.
    try:
        pretrain(cfg, train_valid_test_dataset_provider=train_valid_test_datasets_provider,
                 model_provider=model_provider, model_type=ModelType.encoder_or_decoder, forward_step_func=forward_step)
    except UnsupportedConfiguration as err:  # met inside Megatron's loop, e.g. a checkpoint's optimizer format
        refuse(str(err))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
