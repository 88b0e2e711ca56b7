"""--moe-fp4-experts fp8: the layer spec's experts become FP8Experts, with Megatron's local linear
layers as parameter holders so that the sharded checkpoint keys are SequentialMLP's."""

import functools

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoESubmodules

from ..experts import FP8Experts
from ..options import ExpertsPrecision, FP4Options
from .spec_tree import rewrite_spec


def fp8_experts_builder(options: FP4Options):
    return functools.partial(
        FP8Experts, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        options=options,
    )


def use_fp8_experts(spec, options: FP4Options):
    """`spec` with every MoE layer's experts built as FP8Experts when options.experts is fp8;
    otherwise the same object (Megatron's own experts)."""
    if options.experts is not ExpertsPrecision.FP8 or spec is None:
        return spec
    builder = fp8_experts_builder(options)

    def swap_experts(node):
        if isinstance(node, MoESubmodules):
            node.experts = builder
        return node

    return rewrite_spec(spec, swap_experts)


__all__ = ["fp8_experts_builder", "use_fp8_experts"]
