"""Whether Megatron recomputes a module, from its config: nothing inside a recomputation is kept in
FP4 unless it is exact (docs/design.md §6.4), so the FP8 linears and experts ask before storing MXFP4."""

from typing import FrozenSet


def recomputed_by(modules: FrozenSet[str], config) -> bool:
    """Whether a module that Megatron's selective recompute names `modules` (any of them) is
    recomputed under `config`; under full recompute everything is."""
    granularity = getattr(config, "recompute_granularity", None)
    if granularity == "full":
        return True
    return granularity == "selective" and bool(modules & set(config.recompute_modules or ()))


def selectively_recomputed(module: str, config) -> bool:
    """Whether Megatron's selective recompute re-runs `module` (full recompute, which checkpoints
    whole layers, does not count)."""
    return getattr(config, "recompute_granularity", None) == "selective" and module in (config.recompute_modules or ())
