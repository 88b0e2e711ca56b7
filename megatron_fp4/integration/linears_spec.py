"""--moe-fp4-linears fp8: the layer spec's attention projections, dense MLP and shared experts built
with FP8 linear layers (megatron_fp4.linears). The routed experts are left to experts_spec.py."""

import dataclasses
import functools

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from ..linears import build_fp8_mlp, build_fp8_shared_experts, fp8_mlp_submodules, linear_spec
from ..options import FP4Options, LinearRole, LinearsPrecision, UnsupportedConfiguration
from .spec_tree import rewrite_spec

_ATTENTION = LinearRole.ATTENTION
_MLA_UP = LinearRole.MLA_UP_PROJECTION
# The attention submodules' linear layers: (column-parallel, role, reads the input layernorm's output)
# by field.
_ATTENTION_LINEARS = {
    SelfAttentionSubmodules: {"linear_qkv": (True, _ATTENTION, True), "linear_proj": (False, _ATTENTION, False)},
    MLASelfAttentionSubmodules: {
        # Without q LoRA the one q projection runs inside MLA's up-projection checkpoint.
        "linear_q_proj": (True, _MLA_UP, True), "linear_q_down_proj": (True, _ATTENTION, True),
        "linear_q_up_proj": (True, _MLA_UP, False), "linear_kv_down_proj": (True, _ATTENTION, True),
        "linear_kv_up_proj": (True, _MLA_UP, False), "linear_proj": (False, _ATTENTION, False),
    },
}


def _builds_mlp(node) -> bool:
    """Whether a layer's `mlp` entry builds Megatron's MLP (0.19: a partial of MLP.as_mlp_submodule;
    earlier: a ModuleSpec of MLP)."""
    if isinstance(node, ModuleSpec):
        return node.module is MLP
    return isinstance(node, functools.partial) and getattr(node.func, "__self__", None) is MLP


def _builds_shared_experts(node) -> bool:
    """Whether an MoE layer's `shared_experts` entry builds SharedExpertMLP (0.19: a partial of
    moe_module_specs._build_shared_experts, which picks it unless the config asks for the grouped
    variant; earlier: a ModuleSpec of SharedExpertMLP)."""
    if isinstance(node, ModuleSpec):
        return node.module is SharedExpertMLP
    return isinstance(node, functools.partial) and getattr(node.func, "__name__", "") == "_build_shared_experts"


def _refuse(what: str, node) -> None:
    raise UnsupportedConfiguration(f"--moe-fp4-linears fp8 serves Megatron's local {what} only, not {node!r}: use "
                                   "--transformer-impl local or drop --moe-fp4-linears fp8.")


def use_fp8_linears(spec, options: FP4Options):
    """`spec` with FP8 linear layers outside the routed experts when options.linears is fp8 (but
    for the roles in options.bf16_linears); otherwise the same object."""
    if options.linears is not LinearsPrecision.FP8 or spec is None:
        return spec

    def swap(node):
        linears = _ATTENTION_LINEARS.get(type(node))
        if linears is not None:
            if (getattr(node, "linear_qkv_down_proj", None) is not None
                    and options.fp8_linear(LinearRole.ATTENTION)):
                _refuse("MLA projections (separate q and kv down-projections, not the fused linear_qkv_down_proj)",
                        node.linear_qkv_down_proj)
            for name, (column, role, reads_layernorm_output) in linears.items():
                current = getattr(node, name)
                if current is None or not options.fp8_linear(role):
                    continue
                local = ColumnParallelLinear if column else RowParallelLinear
                params = _local_linear_params(current, local)
                if params is None:
                    # e.g. Transformer Engine's layer-norm-fused linear: replacing it would drop the norm.
                    _refuse(f"attention projections ({name})", current)
                fp8 = linear_spec(column, options, role, reads_layernorm_output)
                object.__setattr__(node, name, dataclasses.replace(fp8, params={**params, **fp8.params}))
        elif (isinstance(node, TransformerLayerSubmodules) and not _is_moe(node.mlp)
              and options.fp8_linear(LinearRole.DENSE_MLP)):
            if _builds_mlp(node.mlp):
                node.mlp = functools.partial(build_fp8_mlp, options=options,
                                             submodules=fp8_mlp_submodules(options, LinearRole.DENSE_MLP))
            elif _has_linears(node.mlp):
                _refuse("MLP", node.mlp)
        elif (isinstance(node, MoESubmodules) and node.shared_experts is not None
              and options.fp8_linear(LinearRole.SHARED_EXPERTS)):
            if not _builds_shared_experts(node.shared_experts):
                _refuse("shared experts", node.shared_experts)
            node.shared_experts = functools.partial(
                build_fp8_shared_experts, submodules=fp8_mlp_submodules(options, LinearRole.SHARED_EXPERTS),
                options=options)
        return node

    return rewrite_spec(spec, swap)


def _local_linear_params(entry, local: type):
    """The spec parameters of an entry that builds Megatron's local linear `local` (the class, or a
    ModuleSpec of it); None for anything else."""
    if entry is local:
        return {}
    if isinstance(entry, ModuleSpec) and entry.module is local and entry.submodules is None:
        return dict(entry.params)
    return None


def _submodules(entry):
    if isinstance(entry, functools.partial):
        return entry.keywords.get("submodules")
    return getattr(entry, "submodules", None)


def _is_moe(mlp) -> bool:
    return isinstance(_submodules(mlp), MoESubmodules)


def _has_linears(mlp) -> bool:
    """Whether an mlp entry other than Megatron's MLP has linear layers (not an identity)."""
    submodules = _submodules(mlp)
    return dataclasses.is_dataclass(submodules) and any(
        f.name.startswith("linear") for f in dataclasses.fields(submodules))
