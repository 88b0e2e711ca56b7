"""Stopping a run that the plugin refuses: one sentence, exit status 2, before any GPU work."""

import sys

from ..console import fail
from ..options import Environment, FP4Options, Route, UnsupportedConfiguration, validate_args


def refuse(sentence: str):
    """Exit with status 2 (argparse's). Every rank prints the sentence: torchrun kills the other
    ranks as soon as the first one exits, so rank 0 alone may never get to."""
    sys.exit(fail(sentence))


def check_args(args, route: Route) -> FP4Options:
    """megatron_fp4.options.validate_args on this machine; a refusal stops the run."""
    try:
        return validate_args(args, route, Environment.here())
    except UnsupportedConfiguration as err:
        refuse(str(err))
