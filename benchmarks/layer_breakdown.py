"""Where a MoE layer's GPU time goes, by kind of kernel: the profiler's kernel names sorted into the
parts of the layer a change would target (the experts' GEMMs, the weights' FP8 copies, the
quantizers, SwiGLU, the router, the permutation, the rest), so that a breakdown can be written as rows and two
commits compared part by part. The first pattern a kernel's name matches decides its part."""

import re
from typing import Dict, Iterable, List, Tuple

# (part, pattern over the kernel's name): ours by their function names (Triton) or entry points
# (CUDA C++), torch's by the op names they carry.
PARTS: List[Tuple[str, str]] = [
    ("expert GEMMs: forward and data gradient", r"grouped_rows_sm90|_grouped_gemm_rows_kernel"),
    ("expert GEMMs: weight gradient", r"grouped_wgrad_sm90|_grouped_wgrad_kernel"),
    ("weights: W^T of the FP8 weights", r"_transpose_fp8_blocks"),
    ("weights: FP8 quantization", r"_quantize_fp8_weight"),
    ("SwiGLU forward and backward", r"_swiglu"),
    ("activation quantizers and MXFP4 -> FP8", r"_quantize_mxfp4|_dequantize_mxfp4|_mxfp4_to_fp8|_quantize_fp8_rows|"
                                               r"_quantize_fp8_cols|_quantize_fp8_both|_dequantize_fp8"),
    # Before the permutation's patterns: long template names of these can hold "index" or "gather".
    ("other GEMMs (router, per-expert scaled_mm, BF16 experts)", r"gemm|Gemm|nvjet|xmma|cutlass"),
    ("router: softmax and top-k", r"[Tt]op[Kk]|SortKV|[Ss]oft[Mm]ax"),
    ("permutation: sort, gathers, scatters, token sums", r"_sum_rows_by_token|[Ss]ort|index|gather|scatter"),
]
OTHER = "other kernels (copies, fills, reductions, element-wise)"


def part_of(kernel_name: str) -> str:
    for part, pattern in PARTS:
        if re.search(pattern, kernel_name):
            return part
    return OTHER


def by_part(kernels: Iterable[Tuple[str, float]]) -> Dict[str, float]:
    """{part: summed time} of (kernel name, time) pairs, every part listed (0 where none ran)."""
    totals = {part: 0.0 for part, _ in PARTS}
    totals[OTHER] = 0.0
    for name, time in kernels:
        totals[part_of(name)] += time
    return totals


def union_length(intervals: Iterable[Tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals, in their unit: a GPU's busy time, kernels
    that overlap counted once."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total
