"""FP8 experts fed by the MXFP4 dispatch (issue 4): module, autograd function, GEMMs."""

from .function import ExpertsCall, FP8ExpertsFunction
from .module import FP8Experts, check_fp8_experts_supported
from .segments import ExpertSegments

__all__ = ["ExpertSegments", "ExpertsCall", "FP8Experts", "FP8ExpertsFunction", "check_fp8_experts_supported"]
