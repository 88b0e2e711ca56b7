"""FP8 linear layers outside the routed experts (--moe-fp4-linears fp8) and the MXFP4 storage of
their saved inputs (--moe-fp4-storage all)."""

from .builders import build_fp8_mlp, build_fp8_shared_experts, fp8_mlp_submodules
from .function import FP8LinearFunction, LinearCall, SavedInput
from .module import (FP8ColumnParallelLinear, FP8RowParallelLinear, LinearRole, LinearSpec, linear_spec,
                     saved_by_its_producer, saved_input)
from .swiglu import MXFP4SavedSwiGLU

__all__ = [
    "FP8ColumnParallelLinear", "FP8LinearFunction", "FP8RowParallelLinear", "LinearCall", "LinearRole", "LinearSpec",
    "MXFP4SavedSwiGLU", "SavedInput", "build_fp8_mlp", "build_fp8_shared_experts", "fp8_mlp_submodules",
    "linear_spec", "saved_by_its_producer", "saved_input",
]
