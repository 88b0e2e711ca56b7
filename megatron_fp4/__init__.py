"""megatron_fp4: MXFP4 dispatch for Megatron-Core MoE layers on Hopper GPUs.

Formats and numerics: docs/formats.md. `megatron_fp4.reference` defines every operation in plain
PyTorch; the Triton kernels below compute the same bytes. It is the tests' oracle, not part of the
production path: import it explicitly (`from megatron_fp4 import reference`).
"""

from .kernels import (
    dequantize_fp8,
    dequantize_mxfp4,
    grouped_gemm_by_weight,
    grouped_wgrad,
    mxfp4_to_fp8_cols,
    mxfp4_to_fp8_rows,
    quantize_fp8_cols,
    quantize_fp8_rows,
    quantize_fp8_rows_and_cols,
    quantize_fp8_weight,
    quantize_fp8_weights,
    quantize_fp8_weights_stacked,
    quantize_mxfp4,
)
from .tensors import COLWISE, ROWWISE, FP8BlockTensor, FP8BlockWeight, FP8StackedWeights, MXFP4Tensor

__all__ = [
    "COLWISE",
    "ROWWISE",
    "FP8BlockTensor",
    "FP8BlockWeight",
    "FP8StackedWeights",
    "MXFP4Tensor",
    "dequantize_fp8",
    "dequantize_mxfp4",
    "grouped_gemm_by_weight",
    "grouped_wgrad",
    "mxfp4_to_fp8_cols",
    "mxfp4_to_fp8_rows",
    "quantize_fp8_cols",
    "quantize_fp8_rows",
    "quantize_fp8_rows_and_cols",
    "quantize_fp8_weight",
    "quantize_fp8_weights",
    "quantize_fp8_weights_stacked",
    "quantize_mxfp4",
]
