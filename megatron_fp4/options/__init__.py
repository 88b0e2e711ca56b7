"""Every switch of the plugin in one typed value, and the one table of configurations it refuses.

`FP4Options` (fp4_options) is built the same way from Megatron's parsed arguments (`from_args`)
and from a `TransformerConfig` that carries our flags (`from_config`, the patch route); the flags
themselves are in `flags`. `validate` (refusals) is the only place a configuration is refused: the
launcher, the patch route, the estimator, `--dry-run` and the MoE layer all call it, with what
`settings` reads of the run. `docs/usage.md` is generated from `FLAGS` and `REFUSALS`
(`python -m megatron_fp4.options` prints it; a test keeps the file in step).
"""

from ..formats import ScaleRule
from .flags import FLAGS, Flag, add_arguments
from .fp4_options import (RECOMPUTED_BY, ExpertsPrecision, FP4Options, GradFormat, LinearRole, LinearsPrecision,
                          Storage)
from .refusals import REFUSALS, Refusal, UnsupportedConfiguration, validate, validate_args
from .settings import (SUPPORTED_MEGATRON_CORE, Environment, ModelSettings, Route, before_megatron_validation,
                       flex_dispatcher_backend, megatron_recompute)
from .usage_table import usage_markdown

__all__ = [
    "Environment",
    "ExpertsPrecision",
    "FLAGS",
    "FP4Options",
    "Flag",
    "GradFormat",
    "LinearRole",
    "LinearsPrecision",
    "ModelSettings",
    "RECOMPUTED_BY",
    "REFUSALS",
    "Refusal",
    "Route",
    "SUPPORTED_MEGATRON_CORE",
    "ScaleRule",
    "Storage",
    "UnsupportedConfiguration",
    "add_arguments",
    "before_megatron_validation",
    "flex_dispatcher_backend",
    "megatron_recompute",
    "usage_markdown",
    "validate",
    "validate_args",
]
