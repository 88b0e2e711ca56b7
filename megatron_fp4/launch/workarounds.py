"""What stock megatron-core 0.19.2 (the wheel, without Megatron-LM's checkout) needs to train
from our launcher; each fix says why. None changes what a run computes."""

import argparse
import functools
import os
import re

from .installed import importable

# Megatron 0.19.2 divides by --eval-interval even when it is unset; unset means "no evaluation
# during training" (its help), so the launcher defaults it past any run length.
NO_EVALUATION_INTERVAL = 2**31 - 1


def escape_percent_in_help(parser: argparse.ArgumentParser) -> None:
    """Megatron 0.19.2 has a help string with a bare '%', which makes argparse's --help crash
    (argparse %-formats help strings): double the bare ones."""
    formatter = parser._get_formatter()
    for action in parser._actions:
        try:
            formatter._expand_help(action)
        except (ValueError, TypeError):
            action.help = re.sub(r"%(?!\()", "%%", action.help)


def use_prebuilt_dataset_helpers() -> None:
    """Megatron's initialize runs `make` in megatron/core/datasets to build its C++ index helpers;
    the wheel ships them compiled but without the Makefile, so that step fails: skip it when there
    is no Makefile and the compiled helpers import (a Megatron-LM checkout still runs its make)."""
    import megatron.core.datasets.utils as dataset_utils

    makefile = os.path.join(os.path.dirname(dataset_utils.__file__), "Makefile")
    if not os.path.exists(makefile) and importable("megatron.core.datasets.helpers_cpp"):
        dataset_utils.compile_helpers = lambda: None


def full_validation_of_one_set() -> None:
    """Megatron 0.18 and 0.19 broadcast --full-validation's iteration counts as one tensor per
    validation set and index the result (training.evaluate_and_print_results), which fails for a
    single validation set (an int: "'int' object is not subscriptable" after the last training
    iteration). Hand it that count as a one-element list for each call; Megatron turns it back into
    the int itself."""
    from megatron.training import get_args
    from megatron.training import training

    evaluate = training.evaluate_and_print_results
    if getattr(evaluate, "listed_eval_iters", False):
        return

    @functools.wraps(evaluate)
    def evaluate_with_listed_eval_iters(*args, **kwargs):
        megatron_args = get_args()
        if (megatron_args.full_validation and not megatron_args.multiple_validation_sets
                and isinstance(megatron_args.eval_iters, int)):
            megatron_args.eval_iters = [megatron_args.eval_iters]
        return evaluate(*args, **kwargs)

    evaluate_with_listed_eval_iters.listed_eval_iters = True
    training.evaluate_and_print_results = evaluate_with_listed_eval_iters


def recompute_without_output_without_transformer_engine() -> None:
    """Megatron 0.18 and 0.19's CheckpointWithoutOutput (--recompute-modules layernorm and moe_act, MLA's
    up-projection recompute) sets `self.fp8 = fp8 is not None`, true for its default fp8=False, and
    then asks Transformer Engine's FP8GlobalStateManager in forward: a NameError when Transformer
    Engine is not installed, for BF16 runs too. Without Transformer Engine there is no FP8 autocast
    state to carry into the recompute, so build those checkpoints with fp8 off."""
    from megatron.core.tensor_parallel import random as megatron_random

    checkpoint = megatron_random.CheckpointWithoutOutput
    if megatron_random.HAVE_TE or getattr(checkpoint.__init__, "fp8_off_without_te", False):
        return
    init = checkpoint.__init__

    @functools.wraps(init)
    def init_with_fp8_off(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.fp8 = False

    init_with_fp8_off.fp8_off_without_te = True
    checkpoint.__init__ = init_with_fp8_off
