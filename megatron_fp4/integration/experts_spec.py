"""--moe-fp4-experts fp8: the layer spec's experts become FP8Experts, with Megatron's local linear
layers as parameter holders so that the sharded checkpoint keys are SequentialMLP's."""

import functools

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoESubmodules

from ..experts import FP8Experts
from .spec_tree import rewrite_spec

EXPERTS_CHOICES = ("bf16", "fp8")


def fp8_experts_builder():
    return functools.partial(
        FP8Experts, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    )


def _swap_experts(node):
    if isinstance(node, MoESubmodules):
        node.experts = fp8_experts_builder()
    return node


def use_fp8_experts(spec, experts: str = "fp8"):
    """`spec` with every MoE layer's experts built as FP8Experts when experts == "fp8"; the same
    object for "bf16" (Megatron's own experts)."""
    if experts not in EXPERTS_CHOICES:
        raise ValueError(f"experts must be one of {EXPERTS_CHOICES}, got {experts!r}")
    if experts == "bf16" or spec is None:
        return spec
    return rewrite_spec(spec, _swap_experts)


__all__ = ["EXPERTS_CHOICES", "fp8_experts_builder", "use_fp8_experts"]
