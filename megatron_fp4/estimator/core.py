"""One estimate: a YAML run config in, per-GPU memory and all-to-all bytes out."""

import dataclasses
from dataclasses import dataclass, field

from ..options import megatron_recompute
from ..run_config import RunConfig, load_config, parse_config_argv
from .a2a import A2ABytes, a2a_bytes, deepep_ranks_per_token
from .device import DeviceRows, device_rows, uses_deepep
from .memory import RankMemory, all_ranks, make_ctx
from .precision import Precision, precision_of
from .recompute import Recompute, recompute_of
from .shapes import EstimateError, ModelShape, Parallel, model_shape, parallel_layout

GIB = 2**30


@dataclass
class Estimate:
    config: str
    mode: str  # "recipe" or "installed" (see precision.py)
    precision: Precision
    recompute: Recompute
    shape: ModelShape
    parallel: Parallel
    gpu_memory_gib: float | None
    ranks: list[RankMemory]
    a2a: A2ABytes  # on the pipeline rank that sends the most
    device: DeviceRows  # device-level memory beside the peak rank's allocated peak (device.py)
    overrides: dict[str, object] = field(default_factory=dict)
    assumed: dict[str, object] = field(default_factory=dict)  # precision fields set by the caller

    @property
    def peak_rank(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.peak)

    @property
    def peak_gib(self) -> float:
        return self.peak_rank.peak / GIB

    @property
    def device_peak_gib(self) -> float:
        """What a GPU monitor would show: the allocated peak plus the device-level rows."""
        return (self.peak_rank.peak + self.device.total) / GIB

    @property
    def fraction(self) -> float | None:
        return self.device_peak_gib / self.gpu_memory_gib if self.gpu_memory_gib else None

    @property
    def verdict(self) -> str | None:
        """'fits' with every device-level row; 'tight' only without the allocator's reserve (which
        it gives back under pressure); else 'OOM'."""
        if self.gpu_memory_gib is None:
            return None
        if self.device_peak_gib <= self.gpu_memory_gib:
            return "fits"
        needed = (self.peak_rank.peak + self.device.outside_allocator) / GIB
        return "tight" if needed <= self.gpu_memory_gib else "OOM"

    @property
    def fits(self) -> bool | None:
        return None if self.verdict is None else self.verdict != "OOM"

    def as_dict(self) -> dict:
        r = self.peak_rank
        return {
            "config": self.config,
            "mode": self.mode,
            "precision": self.precision.name,
            "recompute": self.recompute.label(),
            "overrides": {k: v for k, v in self.overrides.items()},
            "gpu_memory_gib": self.gpu_memory_gib,
            "peak_rank": r.rank,
            "weights_gib": r.static.weights / GIB,
            "grads_gib": r.static.grads / GIB,
            "optimizer_gib": r.static.optimizer / GIB,
            "workspace_gib": r.static.workspace / GIB,
            "wgrad_buffers_gib": r.static.wgrad_buffers / GIB,
            "activations_gib": r.activations / GIB,
            "transient_gib": r.transient / GIB,
            "peak_gib": self.peak_gib,
            "device_gib": {k: v / GIB for k, v in self.device.as_dict().items()},
            "device_peak_gib": self.device_peak_gib,
            "fraction_of_gpu": self.fraction,
            "fits": self.fits,
            "verdict": self.verdict,
            "assumed": dict(self.assumed),
            "microbatches_held": r.held,
            "per_rank_peak_gib": [x.peak / GIB for x in self.ranks],
            "activations_per_microbatch_gib": {k: v / GIB for k, v in sorted(r.components.items())},
            "a2a_gb_per_step": {
                "dispatch_forward": self.a2a.dispatch_forward / 1e9,
                "dispatch_backward": self.a2a.dispatch_backward / 1e9,
                "combine_forward": self.a2a.combine_forward / 1e9,
                "combine_backward": self.a2a.combine_backward / 1e9,
                "recompute_forward": self.a2a.recompute_forward / 1e9,
                "total": self.a2a.total / 1e9,
            },
        }


def apply_overrides(config: RunConfig, overrides: dict[str, object]) -> RunConfig:
    """A copy of `config` with flags replaced (what-if estimates); names are checked like YAML keys."""
    from ..run_config import check_flag as _check_flag

    flags = dict(config.flags)
    for name, value in overrides.items():
        _check_flag(name, value, config.path)
        flags.pop(name, None)
        flags[name] = value
    return RunConfig(path=config.path, flags=flags, cluster=dict(config.cluster))


def estimate(config, mode: str = "recipe", overrides: dict[str, object] | None = None,
             precision: dict[str, object] | None = None) -> Estimate:
    """Estimate a config (a path or a RunConfig). mode "recipe": the paper's FP4 recipe for fp4
    configs; "installed": what the config's flags switch on (identical for bf16 / fp8 configs).
    `precision`: Precision fields to set that no flag expresses (e.g. {"fp8_dispatch": True}, the
    FP8-Flow-MoE fork's FP8 dispatch), an assumption the estimate then carries."""
    if not isinstance(config, RunConfig):
        config = load_config(config)
    overrides = dict(overrides or {})
    if overrides:
        config = apply_overrides(config, overrides)
    args = parse_config_argv(config)
    # The deprecated --moe-layer-recompute, resolved as Megatron resolves it (as the refusals read it).
    args.recompute_granularity, args.recompute_modules = megatron_recompute(
        args.recompute_granularity, args.recompute_modules, bool(getattr(args, "moe_layer_recompute", False)))
    shape = model_shape(args)
    par = parallel_layout(args, shape, config.world_size())
    p = precision_of(args, mode)
    assumed = dict(precision or {})
    if assumed:
        p = dataclasses.replace(p, **assumed)
    rc = recompute_of(args)
    if "mla_up_proj" in rc and not shape.mla:
        raise EstimateError("mla_up_proj recompute needs multi_latent_attention")
    c = make_ctx(args, shape, par, p, rc)
    ranks = all_ranks(args, c)
    # Under the flex dispatcher on DeepEP a token travels once per destination rank (a2a.py).
    deepep_ranks = (deepep_ranks_per_token(shape.experts, shape.topk, par.ep,
                                           getattr(args, "moe_router_num_groups", None),
                                           getattr(args, "moe_router_group_topk", None)) if uses_deepep(args) else None)
    a2a = max((a2a_bytes(shape, par, p, rc, r, deepep_ranks) for r in range(par.pp)), key=lambda a: a.total)
    device = device_rows(args, shape, par, max(r.peak for r in ranks))
    return Estimate(config=str(config.path), mode=mode, precision=p, recompute=rc, shape=shape, parallel=par,
                    gpu_memory_gib=config.cluster.get("gpu_memory_gib"), ranks=ranks, a2a=a2a, device=device,
                    overrides=overrides, assumed=assumed)
