"""FP8 experts fed by the MXFP4 dispatch: module, autograd function, GEMMs."""

from .function import ExpertGemms, ExpertsCall, FP8ExpertsFunction
from .module import FP8Experts
from .segments import ExpertSegments

__all__ = ["ExpertGemms", "ExpertSegments", "ExpertsCall", "FP8Experts", "FP8ExpertsFunction"]
