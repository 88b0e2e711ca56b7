"""The MoE layer breakdown's sorting of kernels into parts: every kernel of ours lands in a named part
(a new kernel must be given one), torch's kernels by their op names, and the GPU's busy time."""

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # benchmarks/ is a folder of the repository, not of the installed package

from benchmarks.layer_breakdown import OTHER, PARTS, by_part, part_of, union_length  # noqa: E402

KERNELS = ROOT / "megatron_fp4" / "kernels"


def _our_kernel_names():
    names = set()
    for path in KERNELS.rglob("*.py"):
        names.update(re.findall(r"@triton\.jit[^\n]*\ndef (\w+_kernel)\(", path.read_text()))
    for path in KERNELS.rglob("*.cu"):
        names.update(re.findall(r"__global__ void(?: __launch_bounds__\([^)]*\))? (\w+)\(", path.read_text()))
    return sorted(names)


def test_every_kernel_of_ours_has_a_part():
    names = _our_kernel_names()
    assert "grouped_rows_sm90" in names and "_quantize_mxfp4_kernel" in names, names
    assert len(names) >= 14, names
    unsorted = [name for name in names if part_of(name) == OTHER]
    assert not unsorted, f"give these kernels a part in benchmarks/layer_breakdown.PARTS: {unsorted}"


@pytest.mark.parametrize("name, part", [
    ("grouped_rows_sm90", "expert GEMMs: forward and data gradient"),
    ("_grouped_gemm_rows_kernel", "expert GEMMs: forward and data gradient"),
    ("grouped_wgrad_sm90", "expert GEMMs: weight gradient"),
    ("_transpose_fp8_blocks_kernel", "weights: W^T of the FP8 weights"),
    ("_quantize_fp8_weight_kernel", "weights: FP8 quantization"),
    ("_quantize_fp8_cols_kernel", "activation quantizers and MXFP4 -> FP8"),
    ("_swiglu_backward_kernel", "SwiGLU forward and backward"),
    ("void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, true>",
     "permutation: sort, gathers, scatters, token sums"),
    ("void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<...>", "permutation: sort, gathers, scatters, token sums"),
    ("nvjet_tst_128x64_64x8_1x2_h_bz_coopA_TNT", "other GEMMs (router, per-expert scaled_mm)"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, ...>", OTHER),
])
def test_kernel_names_sort_into_parts(name, part):
    assert part_of(name) == part


def test_parts_add_up_and_every_part_is_listed():
    totals = by_part([("grouped_rows_sm90", 3.0), ("grouped_rows_sm90", 1.5), ("_swiglu_quantized_kernel", 0.25),
                      ("void at::native::reduce_kernel<...>", 0.5)])
    assert set(totals) == {part for part, _ in PARTS} | {OTHER}
    assert totals["expert GEMMs: forward and data gradient"] == 4.5
    assert totals["SwiGLU forward and backward"] == 0.25 and totals[OTHER] == 0.5
    assert sum(totals.values()) == 5.25


def test_gpu_busy_time_is_the_union_of_the_device_intervals():
    assert union_length([]) == 0
    # Overlapping, nested, touching and disjoint intervals, in any order.
    assert union_length([(5, 8), (0, 2), (1, 3), (10, 12), (12, 13), (6, 7)]) == 3 + 3 + 3
