"""Builders for the dense MLP and the shared experts with FP8 linear layers, called by Megatron as
the layer spec's `mlp` (TransformerLayer) and `shared_experts` (MoELayer) with Megatron's own
arguments. They build Megatron's MLP and SharedExpertMLP classes, so parameters and checkpoint keys
stay Megatron's; under --moe-fp4-storage all (outside recompute) the SwiGLU becomes the activation
module that keeps its input in MXFP4.
"""

import copy
import functools
from typing import Optional

from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

from ..options import FP4Options, UnsupportedConfiguration
from .function import SavedInput
from .module import LinearRole, linear_spec, saved_input
from .swiglu import MXFP4SavedSwiGLU


def fp8_mlp_submodules(options: FP4Options, role: LinearRole) -> MLPSubmodules:
    # fc1 reads the pre-MLP layernorm's output (the dense MLP and the shared experts alike).
    return MLPSubmodules(linear_fc1=linear_spec(True, options, role, reads_layernorm_output=True),
                         linear_fc2=linear_spec(False, options, role))


def _with_activation(config, submodules: MLPSubmodules, options: FP4Options, role: LinearRole):
    """(config, submodules) for Megatron's MLP: unchanged, or with the MXFP4-saving SwiGLU as its
    activation module when the role's inputs are stored in MXFP4."""
    if saved_input(options, role, config) is not SavedInput.MXFP4:
        return config, submodules
    if not config.gated_linear_unit:
        raise UnsupportedConfiguration("--moe-fp4-storage all keeps SwiGLU inputs in MXFP4 and needs --swiglu.")
    config = copy.copy(config)
    config.use_te_activation_func = True  # MLP then calls submodules.activation_func's module
    config.bias_activation_fusion = False  # Megatron refuses both at once
    activation = functools.partial(MXFP4SavedSwiGLU, scale_rule=options.scale_rule.value)
    return config, MLPSubmodules(submodules.linear_fc1, submodules.linear_fc2, activation)


def build_fp8_mlp(*, submodules: MLPSubmodules, options: FP4Options, config, pg_collection, is_mtp_layer: bool,
                  is_expert: bool = False, input_size: Optional[int] = None, ffn_hidden_size: Optional[int] = None,
                  name: Optional[str] = None) -> MLP:
    """A transformer layer's dense MLP (MLP.as_mlp_submodule's arguments)."""
    config, submodules = _with_activation(config, submodules, options, LinearRole.DENSE_MLP)
    return MLP(config=config, submodules=submodules, tp_group=pg_collection.tp, is_expert=is_expert,
               input_size=input_size, ffn_hidden_size=ffn_hidden_size, name=name)


def build_fp8_shared_experts(*, submodules: MLPSubmodules, options: FP4Options, config, pg_collection, gate: bool,
                             name: Optional[str] = None) -> SharedExpertMLP:
    """An MoE layer's shared experts (the arguments MoELayer passes)."""
    if getattr(config, "use_grouped_gemm_for_shared_expert", False):
        raise UnsupportedConfiguration("--moe-fp4-linears fp8 builds the shared experts as SharedExpertMLP: drop "
                                       "--use-grouped-gemm-for-shared-expert.")
    config, submodules = _with_activation(config, submodules, options, LinearRole.SHARED_EXPERTS)
    return SharedExpertMLP(config=config, submodules=submodules, gate=gate, pg_collection=pg_collection, name=name)
