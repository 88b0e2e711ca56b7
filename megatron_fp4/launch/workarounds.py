"""What stock megatron-core 0.19.2 (the wheel, without Megatron-LM's checkout) needs to train
from our launcher; each fix says why. None changes what a run computes."""

import argparse
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
    the wheel ships them compiled but without the Makefile, so that step fails: skip it when the
    compiled helpers import."""
    if importable("megatron.core.datasets.helpers_cpp"):
        import megatron.core.datasets.utils as dataset_utils

        dataset_utils.compile_helpers = lambda: None
