"""FP8 experts fed by the MXFP4 dispatch: the module and its autograd function (the GEMMs, weight
cache and segments they share with the FP8 linears are in megatron_fp4.fp8)."""

from .function import ExpertGemms, ExpertsCall, FP8ExpertsFunction
from .module import FP8Experts

__all__ = ["ExpertGemms", "ExpertsCall", "FP8Experts", "FP8ExpertsFunction"]
