"""What a built model runs in FP4 and FP8, against what the flags ask.

A training script can pass our flags and still build Megatron's stock layers (a spec line left out,
or placed where the model is not built from it). `take_census` counts, over the model chunks of
one rank, each place the flags ask for one of our modules and whether it holds one; `census_line`
says it in one line and `shortfall` is the refusal when any place holds a stock module.
"""

from dataclasses import dataclass, field
from typing import Iterable, Optional

from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock, MultiTokenPredictionLayer
from megatron.core.transformer.transformer_layer import TransformerLayer

from ..attention import FusedCoreAttention
from ..experts import FP8Experts
from ..experts.recomputed import recomputes_in_backward
from ..linears import FP8ColumnParallelLinear, FP8RowParallelLinear
from ..options import ExpertsPrecision, FP4Options, LinearRole
from .moe_layer import FP4MoELayer


@dataclass
class Count:
    """Places the flags ask for one of our modules (`asked`) and those that hold one (`served`)."""

    asked: int = 0
    served: int = 0

    def add(self, served: bool) -> None:
        self.asked += 1
        self.served += bool(served)

    @property
    def short(self) -> bool:
        return self.served < self.asked


@dataclass
class Census:
    moe_layers: Count = field(default_factory=Count)  # decoder MoE layers dispatching in MXFP4
    mtp_moe_layers: Count = field(default_factory=Count)  # the same inside MTP layers
    experts: Count = field(default_factory=Count)  # MoE layers' experts in FP8
    recomputed_experts: Count = field(default_factory=Count)  # MoE layers' experts recomputed alone
    linears: Count = field(default_factory=Count)  # linear layers of the FP8 roles
    attention: Count = field(default_factory=Count)  # core attentions on the fused kernels
    fp8_linears: int = 0  # every FP8 linear layer of the model


def _is_fp8(linear) -> bool:
    return isinstance(linear, (FP8ColumnParallelLinear, FP8RowParallelLinear))


def _count_linears(census: Census, layer: TransformerLayer, options: FP4Options) -> None:
    """One place per role the flags turn FP8: the attention's output projection, MLA's kv
    up-projection, the dense MLP's and the shared experts' second linear layer."""
    attention = getattr(layer, "self_attention", None)
    if options.fp8_linear(LinearRole.ATTENTION) and hasattr(attention, "linear_proj"):
        census.linears.add(_is_fp8(attention.linear_proj))
    if options.fp8_linear(LinearRole.MLA_UP_PROJECTION) and hasattr(attention, "linear_kv_up_proj"):
        census.linears.add(_is_fp8(attention.linear_kv_up_proj))
    mlp = getattr(layer, "mlp", None)
    if isinstance(mlp, MoELayer):
        shared = getattr(mlp, "shared_experts", None)
        if options.fp8_linear(LinearRole.SHARED_EXPERTS) and shared is not None:
            census.linears.add(_is_fp8(shared.linear_fc2))
    elif options.fp8_linear(LinearRole.DENSE_MLP) and isinstance(mlp, MLP):
        census.linears.add(_is_fp8(mlp.linear_fc2))


def take_census(chunks: Iterable, options: FP4Options) -> Census:
    """Count over the modules holding this rank's layers (model chunks, decoder blocks, MTP layers;
    wrappers are fine; a module reached twice counts once)."""
    census = Census()
    seen = set()
    for chunk in chunks:
        modules = list(chunk.modules())
        mtp = (MultiTokenPredictionBlock, MultiTokenPredictionLayer)
        in_mtp = {id(m) for block in modules if isinstance(block, mtp) for m in block.modules()}
        for module in modules:
            if id(module) in seen:
                continue
            seen.add(id(module))
            if isinstance(module, (FP8ColumnParallelLinear, FP8RowParallelLinear)):
                census.fp8_linears += 1
            if not isinstance(module, TransformerLayer):
                continue
            mlp = getattr(module, "mlp", None)
            if isinstance(mlp, MoELayer):
                if options.dispatch:
                    count = census.mtp_moe_layers if id(module) in in_mtp else census.moe_layers
                    count.add(isinstance(mlp, FP4MoELayer))
                if options.experts is ExpertsPrecision.FP8:
                    census.experts.add(isinstance(mlp.experts, FP8Experts))
                if options.recompute_experts:
                    census.recomputed_experts.add(recomputes_in_backward(mlp.experts))
            attention = getattr(module, "self_attention", None)
            if options.fused_attention and hasattr(attention, "core_attention"):
                census.attention.add(isinstance(attention.core_attention, FusedCoreAttention))
            _count_linears(census, module, options)
    return census


def census_line(census: Census, options: FP4Options) -> str:
    """e.g. `megatron_fp4: 5 of 5 MoE layers and 1 of 1 MTP layers: MXFP4 dispatch, FP8 experts;
    14 of 14 linear layers of the FP8 roles (26 FP8 linear layers)`."""
    parts = []
    if options.dispatch or options.experts is ExpertsPrecision.FP8:
        layers = census.moe_layers if options.dispatch else census.experts
        what = [w for w, on in (("MXFP4 dispatch", options.dispatch),
                                ("FP8 experts", options.experts is ExpertsPrecision.FP8)) if on]
        text = f"{layers.served} of {layers.asked} MoE layers"
        if census.mtp_moe_layers.asked:
            text += f" and {census.mtp_moe_layers.served} of {census.mtp_moe_layers.asked} MTP layers"
        if options.dispatch and options.experts is ExpertsPrecision.FP8:
            text += f" ({census.experts.served} of {census.experts.asked} with FP8 experts)"
        parts.append(f"{text}: {', '.join(what)}")
    if options.linears.value == "fp8":
        parts.append(f"{census.linears.served} of {census.linears.asked} linear layers of the FP8 roles "
                     f"({census.fp8_linears} FP8 linear layers)")
    if options.fused_attention:
        parts.append(f"{census.attention.served} of {census.attention.asked} core attentions fused")
    if options.recompute_experts:
        parts.append(f"{census.recomputed_experts.served} of {census.recomputed_experts.asked} MoE layers' experts "
                     "recomputed from their dispatched input")
    return "megatron_fp4: " + "; ".join(parts)


# (count, what the flags ask for, the flag)
def _asks(census: Census):
    return ((census.moe_layers, "MoE layers dispatching in MXFP4", "--moe-fp4-dispatch"),
            (census.mtp_moe_layers, "MTP layers' MoE layers dispatching in MXFP4", "--moe-fp4-dispatch"),
            (census.experts, "FP8 experts", "--moe-fp4-experts fp8"),
            (census.linears, "FP8 linear layers", "--moe-fp4-linears fp8"),
            (census.attention, "fused core attention", "--moe-fp4-fused-attention"),
            (census.recomputed_experts, "experts recomputed alone", "--moe-fp4-recompute-experts"))


def shortfall(census: Census, options: FP4Options) -> Optional[str]:
    """The refusal sentence when a place the flags ask for holds a stock module, else None. A rank
    whose chunks hold none of the asked-for places (a pipeline stage of dense layers) has no
    shortfall; the flags asking for MoE layers in a model without any are refused at start-up."""
    for count, what, flag in _asks(census):
        if count.short:
            return (f"{flag} asks for {what}, and the model on this rank has {count.served} of {count.asked}: "
                    "the training script builds Megatron's layers without megatron_fp4's layer spec; apply "
                    "the lines of docs/integration.md for your Megatron-LM release.")
    return None


__all__ = ["Census", "Count", "census_line", "shortfall", "take_census"]
