"""--moe-fp4-experts fp8: the layer spec's experts become FP8Experts, with Megatron's local linear
layers as parameter holders so that the sharded checkpoint keys are SequentialMLP's.
--moe-fp4-recompute-experts with Megatron's own experts: their class recomputed in backward."""

import functools

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from ..experts import FP8Experts
from ..experts.recomputed import experts_recomputed
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


def use_recomputed_experts(spec, options: FP4Options):
    """`spec` with Megatron's own experts recomputed in backward when options.recompute_experts
    (FP8Experts recompute by themselves); otherwise the same object."""
    if not options.recompute_experts or options.experts is ExpertsPrecision.FP8 or spec is None:
        return spec

    def recomputed(node):
        if isinstance(node, MoESubmodules):
            experts = node.experts
            if isinstance(experts, functools.partial):
                node.experts = functools.partial(experts_recomputed(experts.func), *experts.args, **experts.keywords)
            elif isinstance(experts, ModuleSpec):
                experts.module = experts_recomputed(experts.module)
            else:
                raise TypeError(f"--moe-fp4-recompute-experts: the spec builds the experts with {experts!r}, "
                                "neither a class partial nor a ModuleSpec")
        return node

    return rewrite_spec(spec, recomputed)


__all__ = ["fp8_experts_builder", "use_fp8_experts", "use_recomputed_experts"]
