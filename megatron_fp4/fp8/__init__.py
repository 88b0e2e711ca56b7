"""What the FP8 experts and the FP8 linear layers share, over the kernels: the token segments a
GEMM runs over, the cuBLASLt GEMMs one segment at a time, and the FP8 weights cached per optimizer
step. A dense linear layer is one segment holding every token."""

from .gemm import segment_products, segment_wgrad
from .segments import TokenSegments
from .weight_cache import FP8WeightCache, fp8_weights, step_cache

__all__ = ["FP8WeightCache", "TokenSegments", "fp8_weights", "segment_products", "segment_wgrad",
           "step_cache"]
