"""FP8ColumnParallelLinear and FP8RowParallelLinear: Megatron's local linear layers (same
parameters, initialization and checkpoint keys) whose forward and backward are FP8 GEMMs
(function.py). Tensor parallelism 1 only, no bias.

Each layer is built for a role in the transformer layer; the role says whether Megatron recomputes
it (--recompute-modules), and a recomputed layer keeps its input in FP8 even under
--moe-fp4-storage all: nothing inside a recomputation is stored in FP4. At each forward a layer
whose input the producing op keeps for its own backward (the fused attention's output, read by
the output projection) keeps that tensor by reference instead, whatever the role's storage.
"""

import copy
from dataclasses import dataclass, field
from typing import Optional

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from ..formats import FP8_BLOCK
from ..fp8 import FP8WeightCache, step_cache
from ..options import (RECOMPUTED_BY, FP4Options, GradFormat, LinearRole, ModelSettings, Route, Storage,
                       UnsupportedConfiguration,
                       validate)
from ..recompute_scope import recomputed_by, selectively_recomputed
from .function import FP8LinearFunction, LinearCall, SavedInput


def saved_input(options: FP4Options, role: LinearRole, config, reads_layernorm_output: bool = False) -> SavedInput:
    """How a linear layer of `role` keeps its input for the weight gradient; `reads_layernorm_output`:
    its input is the output of the layer's input or pre-MLP layernorm."""
    if recomputed_by(RECOMPUTED_BY[role], config):
        return SavedInput.FP8  # inside a recomputation: nothing inexact in FP4, and only until its backward
    if reads_layernorm_output and selectively_recomputed("layernorm", config):
        return SavedInput.ORIGINAL
    return SavedInput.MXFP4 if options.storage is Storage.ALL else SavedInput.FP8


def _check_layer(kind: str, input_size: int, output_size: int, bias: bool, name: Optional[str]) -> None:
    what = f"--moe-fp4-linears fp8: {kind} {name or ''}".rstrip()
    if input_size % FP8_BLOCK:
        raise UnsupportedConfiguration(f"{what} has {input_size} input features; FP8 1x128 blocks need a multiple of "
                                       f"{FP8_BLOCK}: change the model's sizes or drop --moe-fp4-linears fp8.")
    if bias:
        raise UnsupportedConfiguration(f"{what} asks for a bias, which the FP8 linears do not have: add "
                                       "--disable-bias-linear (and no --add-qkv-bias).")


def _weight_holder_config(config):
    """Megatron's layer checks for apex's fused wgrad kernel when gradient accumulation is fused;
    our backward does that accumulation itself, so the parent never needs the kernel."""
    holder = copy.copy(config)
    holder.gradient_accumulation_fusion = False
    return holder


@dataclass
class _FP8Settings:
    """What an FP8 linear layer's forward needs, fixed when the layer is built."""

    saved: SavedInput
    scale_rule: str
    accumulate_in_main_grad: bool
    weight_cache: Optional[FP8WeightCache] = field(default=None)
    grad_format: GradFormat = GradFormat.FP8

    @classmethod
    def of(cls, options: FP4Options, role: LinearRole, config, reads_layernorm_output: bool = False) -> "_FP8Settings":
        if not options.fp8_linear(role):
            raise ValueError(f"an FP8 linear layer ({role.value}) was built without --moe-fp4-linears fp8 or with "
                             "its role in --moe-fp4-bf16-linears")
        validate(options, ModelSettings.from_config(config), None, Route.PLUGIN)
        return cls(saved_input(options, role, config, reads_layernorm_output), options.scale_rule.value,
                   bool(config.gradient_accumulation_fusion), step_cache(options),
                   options.linears_grad)


# Whether saved-tensor hooks are active here (what save_for_backward asks), without a public query:
# a torch private function; where a release lacks it, hooks count as active (keep a copy: safe).
_top_saved_tensor_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _saved_tensor_hooks_active() -> bool:
    return _top_saved_tensor_hooks is None or _top_saved_tensor_hooks(False) is not None


def saved_by_its_producer(x: torch.Tensor) -> bool:
    """Whether the op that produced x (x itself or the tensor x is a view of) keeps x's storage for
    its own backward as the tensor itself: torch's fused SDPA kernels save their output, which the
    attention output projection reads reshaped. A linear layer then keeps x by reference at no cost:
    its backward runs before its producer's, which frees that storage. Read off the autograd graph
    at forward; False where a saved-tensor hook packed that output (offloading: its package, not
    the tensor) or packs what this layer saves, and wherever the storage is another one (a copy)."""
    produced = x if x._base is None else x._base
    saved = getattr(produced.grad_fn, "_raw_saved_output", None)
    if saved is None or _saved_tensor_hooks_active():
        return False
    kept = saved.data  # what the producer holds, not unpacked: the tensor, or a hook's package of it
    return isinstance(kept, torch.Tensor) and kept.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


def _fp8_forward(settings: _FP8Settings, input_: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # Decided here: inside the autograd function grad mode is always off.
    backward_follows = torch.is_grad_enabled() and (input_.requires_grad or weight.requires_grad)
    saved = SavedInput.ORIGINAL if backward_follows and saved_by_its_producer(input_) else settings.saved
    call = LinearCall(saved, settings.scale_rule, settings.accumulate_in_main_grad, backward_follows,
                      settings.weight_cache, settings.grad_format)
    return FP8LinearFunction.apply(call, input_, weight)


class FP8ColumnParallelLinear(ColumnParallelLinear):
    def __init__(self, input_size: int, output_size: int, *, config, options: FP4Options, role: LinearRole,
                 reads_layernorm_output: bool = False, bias: bool = True, gather_output: bool = False,
                 name: Optional[str] = None, **kwargs):
        _check_layer("column-parallel layer", input_size, output_size, bias, name)
        super().__init__(input_size, output_size, config=_weight_holder_config(config), bias=bias,
                         gather_output=gather_output, name=name, **kwargs)
        self.fp8 = _FP8Settings.of(options, role, config, reads_layernorm_output)

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None):
        if weight is not None:
            raise ValueError("FP8ColumnParallelLinear does not take a weight at forward (shared embeddings)")
        return _fp8_forward(self.fp8, input_, self.weight), None


class FP8RowParallelLinear(RowParallelLinear):
    def __init__(self, input_size: int, output_size: int, *, config, options: FP4Options, role: LinearRole,
                 bias: bool = True, name: Optional[str] = None, **kwargs):
        _check_layer("row-parallel layer", input_size, output_size, bias, name)
        super().__init__(input_size, output_size, config=_weight_holder_config(config), bias=bias, name=name,
                         **kwargs)
        self.fp8 = _FP8Settings.of(options, role, config)

    def forward(self, input_: torch.Tensor):
        return _fp8_forward(self.fp8, input_, self.weight), None


@dataclass(frozen=True, eq=False)
class LinearSpec:
    """A linear layer in a layer spec, usable where Megatron calls the spec (`submodules.linear_fc1(...)`)
    and where it builds it (`build_module`, which reads `module` and `params`)."""

    module: type
    params: dict

    def __call__(self, *args, **kwargs):
        return self.module(*args, **self.params, **kwargs)

    def __eq__(self, other):
        # Also equal to the Megatron class the layer derives from: MLA's constructor picks its
        # down-projections' arguments with `spec in [..., ColumnParallelLinear]` and refuses others.
        if isinstance(other, type):
            return issubclass(self.module, other)
        return isinstance(other, LinearSpec) and (self.module, self.params) == (other.module, other.params)


def linear_spec(column: bool, options: FP4Options, role: LinearRole, reads_layernorm_output: bool = False) -> LinearSpec:
    """`reads_layernorm_output`: the layer's input is a layernorm's output (column-parallel layers only)."""
    if not column:
        if reads_layernorm_output:
            raise ValueError("only column-parallel layers read a layernorm's output here")
        return LinearSpec(FP8RowParallelLinear, {"options": options, "role": role})
    return LinearSpec(FP8ColumnParallelLinear,
                      {"options": options, "role": role, "reads_layernorm_output": reads_layernorm_output})
