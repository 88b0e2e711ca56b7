"""Per-GPU memory and expert-parallel all-to-all bytes of a training config, before running it.

    from megatron_fp4.estimator import estimate
    e = estimate("configs/deepseek_v3_671b/fp4_mla_up_proj.yaml")
    e.peak_gib, e.fits, e.a2a.total

`megatron-fp4 estimate CONFIG ...` prints the same as a table (cli.py). How the numbers are built:
docs/estimator.md.
"""

from .core import GIB, Estimate, estimate
from .shapes import EstimateError


def register(subparsers) -> None:
    from .cli import register as _register

    _register(subparsers)


__all__ = ["GIB", "Estimate", "EstimateError", "estimate", "register"]
