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
    ("nvjet_tst_128x64_64x8_1x2_h_bz_coopA_TNT", "other GEMMs (router, per-expert scaled_mm, BF16 experts)"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>(...)",
     "other GEMMs (router, per-expert scaled_mm, BF16 experts)"),
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(at::cuda::detail::TensorInfo<...>)",
     "router: softmax and top-k"),
    ("void at::native::bitonicSortKVInPlace<2, -1, 16, 16, float, long, at::native::GTOp<float, true>, unsigned int>",
     "router: softmax and top-k"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous "
     "namespace)::SoftMaxForwardEpilogue>", "router: softmax and top-k"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, ...>", OTHER),
])
def test_kernel_names_sort_into_parts(name, part):
    assert part_of(name) == part


def test_parts_add_up_and_every_part_is_listed():
    totals = by_part([("grouped_rows_sm90", 3.0), ("grouped_rows_sm90", 1.5), ("_swiglu_quantized_kernel", 0.25),
                      ("void at::native::reduce_kernel<...>", 0.5)])
    assert part_of("void at::native::reduce_kernel<...>") == OTHER
    assert set(totals) == {part for part, _ in PARTS} | {OTHER}
    assert totals["expert GEMMs: forward and data gradient"] == 4.5
    assert totals["SwiGLU forward and backward"] == 0.25 and totals[OTHER] == 0.5
    assert sum(totals.values()) == 5.25


def test_gpu_busy_time_is_the_union_of_the_device_intervals():
    assert union_length([]) == 0
    # Overlapping, nested, touching and disjoint intervals, in any order.
    assert union_length([(5, 8), (0, 2), (1, 3), (10, 12), (12, 13), (6, 7)]) == 3 + 3 + 3


def test_profile_rows_split_forward_and_backward_and_count_idle_time():
    """profile_moe_layer --rows: per part, forward (profiled alone) and backward (the step's time less
    the forward's, never below 0) per step, and the GPU's idle time (wall less the union of the
    kernels' intervals), each against the wall time; rows follow the schema."""
    from types import SimpleNamespace

    import torch

    from benchmarks import profile_moe_layer as profile
    from benchmarks.rows import Recorder, row_problems

    def kernel(name, start, end):
        interval = SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
        return SimpleNamespace(name=name, time_range=interval, device_type=torch.autograd.DeviceType.CUDA)

    host_op = SimpleNamespace(name="aten::mm", time_range=None, device_type=torch.autograd.DeviceType.CPU)
    # Two steps: GEMMs 3000 us each (overlapping 1000 us in the second), SwiGLU 500 us, in [0, 9000] us.
    events = [kernel("grouped_rows_sm90", 0, 3000), kernel("_swiglu_backward_kernel", 3000, 3500), host_op,
              kernel("grouped_rows_sm90", 5000, 8000), kernel("grouped_wgrad_sm90", 7000, 9000)]
    prof = SimpleNamespace(events=lambda: events)
    forward = {part: 0.0 for part, _ in PARTS} | {OTHER: 0.0}
    forward["expert GEMMs: forward and data gradient"] = 1.0  # ms per step
    forward["SwiGLU forward and backward"] = 0.5  # more than the step's 0.25: backward clamps at 0
    recorder = Recorder("moe_layer_breakdown", gpus=1)
    profile.record_breakdown(recorder, "fp4-fp8", prof, 2, forward, 5.0, lambda *_: None)
    got = {row["metric"]: row for row in recorder.rows}
    assert all(row_problems(row) == [] for row in recorder.rows)
    assert all(row["reference_value"] == 5.0 and row["case"] == "fp4-fp8" for row in recorder.rows)
    gemms = "GPU time: expert GEMMs: forward and data gradient"
    assert got[f"{gemms}, forward"]["value"] == 1.0 and got[f"{gemms}, backward"]["value"] == 2.0
    assert got["GPU time: expert GEMMs: weight gradient, backward"]["value"] == 1.0
    assert got["GPU time: SwiGLU forward and backward, backward"]["value"] == 0.0
    # busy: [0, 3500] and [5000, 9000] -> 7.5 ms over two steps; wall 5 ms a step -> 1.25 ms idle
    assert got["GPU idle (wall - GPU busy)"]["value"] == 5.0 - 7.5 / 2
    assert len(recorder.rows) == 2 * (len(PARTS) + 1) + 1
