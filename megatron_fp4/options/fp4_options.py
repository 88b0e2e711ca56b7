"""What the user asks of the plugin: `FP4Options`, one typed value of every switch, and the enums
of its values."""

import enum
from dataclasses import dataclass, fields
from typing import FrozenSet

from ..formats import ScaleRule


def flag_attribute(field: str) -> str:
    """The attribute of Megatron's parsed arguments (and of a patched TransformerConfig) that holds
    the FP4Options field `field`."""
    return f"moe_fp4_{field}"


class GradFormat(enum.StrEnum):
    BF16 = "bf16"  # the gradient unquantized, in the model's dtype
    FP8 = "fp8"  # E4M3 rows with 1x128 power-of-two scales


class ExpertsPrecision(enum.StrEnum):
    BF16 = "bf16"  # Megatron's own experts
    FP8 = "fp8"  # ours: FP8 GEMMs fed from the MXFP4 payload


class LinearsPrecision(enum.StrEnum):
    BF16 = "bf16"  # Megatron's own linear layers
    FP8 = "fp8"  # ours (megatron_fp4.linears): FP8 blockwise GEMMs outside the routed experts


class LinearRole(enum.StrEnum):
    """Where a linear layer outside the routed experts sits; the names of Megatron's selective
    recompute modules, which --moe-fp4-bf16-linears also takes."""

    ATTENTION = "attention"  # q/kv down-projections, qkv, output projection: no selective recompute
    MLA_UP_PROJECTION = "mla_up_proj"  # MLA's q and kv up-projections
    DENSE_MLP = "mlp"
    SHARED_EXPERTS = "shared_experts"


# Megatron's selective-recompute modules that re-run a role's layers (`moe` checkpoints the whole
# MoE layer, shared experts included); full recompute re-runs every role.
RECOMPUTED_BY = {
    LinearRole.ATTENTION: frozenset(),
    LinearRole.MLA_UP_PROJECTION: frozenset({"mla_up_proj"}),
    LinearRole.DENSE_MLP: frozenset({"mlp"}),
    LinearRole.SHARED_EXPERTS: frozenset({"shared_experts", "moe"}),
}


class Storage(enum.StrEnum):
    """Where activations saved for backward are kept in MXFP4."""

    # Nowhere inexact: the routed FP8 experts keep the received payload (exact FP4 values) but their
    # SwiGLU input in BF16 and fc2 input as FP8 columns, as the FP8 baseline and recompute keep them
    NONE = "none"
    EXPERTS = "experts"  # inside the routed FP8 experts only (their SwiGLU and fc2 inputs)
    ALL = "all"  # the paper's recipe: also every FP8 linear's saved input and every SwiGLU input


@dataclass(frozen=True)
class FP4Options:
    dispatch: bool = False
    dispatch_grad: GradFormat = GradFormat.BF16
    scale_rule: ScaleRule = ScaleRule.CEIL
    cache: bool = False
    saved_input: bool = False
    experts: ExpertsPrecision = ExpertsPrecision.BF16
    telemetry: bool = False
    weights_per_use: bool = False
    keep_transposed_weights: bool = False  # W^T kept for the step beside W
    linears: LinearsPrecision = LinearsPrecision.BF16
    storage: Storage = Storage.EXPERTS
    bf16_linears: FrozenSet[LinearRole] = frozenset()  # roles --moe-fp4-linears fp8 leaves to Megatron
    linears_grad: GradFormat = GradFormat.FP8  # the FP8 linears' backward GEMMs
    fused_attention: bool = False
    recompute_experts: bool = False  # the routed experts recomputed from their dispatched input

    def __post_init__(self):
        # Accept the flags' strings; keep the enums.
        object.__setattr__(self, "dispatch_grad", GradFormat(self.dispatch_grad))
        object.__setattr__(self, "scale_rule", ScaleRule(self.scale_rule))
        object.__setattr__(self, "experts", ExpertsPrecision(self.experts))
        object.__setattr__(self, "linears", LinearsPrecision(self.linears))
        object.__setattr__(self, "storage", Storage(self.storage))
        object.__setattr__(self, "bf16_linears", frozenset(LinearRole(r) for r in self.bf16_linears))
        object.__setattr__(self, "linears_grad", GradFormat(self.linears_grad))

    @property
    def active(self) -> bool:
        """Whether anything of the plugin touches the model (off: stock Megatron)."""
        return (self.touches_moe_layers or self.linears is LinearsPrecision.FP8 or self.fused_attention
                or self.recompute_experts)

    @property
    def touches_moe_layers(self) -> bool:
        """Whether the plugin builds parts of the MoE layers (the FP8 linears and the fused attention,
        which also serve dense layers, alone do not)."""
        return self.dispatch or self.experts is ExpertsPrecision.FP8

    def fp8_linear(self, role: LinearRole) -> bool:
        """Whether the linear layers of `role` are ours (FP8) rather than Megatron's."""
        return self.linears is LinearsPrecision.FP8 and role not in self.bf16_linears

    @classmethod
    def from_args(cls, args) -> "FP4Options":
        """From Megatron's parsed arguments (or any object with the flags' attribute names, which a
        patched TransformerConfig also has)."""
        values = {}
        for field in fields(cls):  # each field's flag (megatron_fp4.options.flags) sets this attribute
            value = getattr(args, flag_attribute(field.name), None)
            if value is not None:
                values[field.name] = value
        return cls(**values)

    from_config = from_args  # the patch route copies the moe_fp4_* arguments onto the config
