"""Triton kernels, one file per operation, each behind a validating Python entry point; the grouped
FP8 GEMMs behind one (grouped_fp8_gemm.py) over two backends, Triton (grouped_gemm_triton.py) and CUDA
C++ for SM90 GPUs (sm90/, grouped_gemm_sm90.py). The bottom floor: nothing here imports the packages
built on it (fp8, experts, linears, dispatch)."""

from ._checks import TileConfig
from .fp8_dequantize import dequantize_fp8
from .fp8_quantize import quantize_fp8_rows
from .fp8_quantize_both import quantize_fp8_rows_and_cols
from .fp8_quantize_cols import quantize_fp8_cols
from .fp8_quantize_weight import quantize_fp8_weight, quantize_fp8_weights, quantize_fp8_weights_stacked
from .fp8_transpose_weight import transpose_fp8_weights
from .grouped_fp8_gemm import grouped_gemm_by_weight, grouped_wgrad
from .grouped_gemm_tiles import GemmBackend, GemmTiles
from .mxfp4_dequantize import dequantize_mxfp4
from .mxfp4_quantize import quantize_mxfp4
from .mxfp4_to_fp8 import mxfp4_to_fp8_cols, mxfp4_to_fp8_rows

__all__ = [
    "GemmBackend",
    "GemmTiles",
    "TileConfig",
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
    "transpose_fp8_weights",
]
