"""The grouped weight gradient in CUDA C++ for Hopper (sm90/grouped_wgrad.cu): persistent CTAs of a
producer warpgroup and two consumer warpgroups on 128 x 128 tiles, the same sums as the Triton
kernel of grouped_fp8_gemm. Launched by grouped_fp8_gemm.grouped_wgrad with `GemmTiles.cuda_sm90`."""

import ctypes
import os
from functools import lru_cache

import torch

from ..formats import FP8_BLOCK
from ._cuda_runtime import CudaKernel, compile_cubin, tile_map

SOURCE = os.path.join(os.path.dirname(__file__), "sm90", "grouped_wgrad.cu")
KERNEL = "grouped_wgrad_sm90"
THREADS = 3 * 128  # a producer warpgroup and two consumer warpgroups
STAGE_BYTES = 2 * FP8_BLOCK * FP8_BLOCK + 2 * FP8_BLOCK * 4 + 2 * 8  # two FP8 tiles, their scales, two barriers
OUT_TILE_BYTES = FP8_BLOCK * FP8_BLOCK * 2  # a BF16 output tile on its way out
MAX_EXPERTS = 1024  # the segment offsets live in shared memory
SHARED_LIMIT = 227 * 1024  # what one block may ask for on Hopper
# The kernel's OutputMode.
STORE_BF16, STORE_FP32, ACCUMULATE_FP32 = 0, 1, 2


def shared_bytes(stages: int) -> int:
    # + the alignment of the swizzled tiles to 1024 bytes
    return stages * STAGE_BYTES + OUT_TILE_BYTES + 8 * (MAX_EXPERTS + 1) + 1024


STAGE_COUNTS = range(2, (SHARED_LIMIT - shared_bytes(0)) // STAGE_BYTES + 1)  # 2 to 5


def check_stages(name: str, stages: int) -> None:
    if stages not in STAGE_COUNTS:
        raise ValueError(f"{name}: the CUDA kernel takes {STAGE_COUNTS.start} to {STAGE_COUNTS.stop - 1} stages "
                         f"({STAGE_BYTES} bytes of shared memory each), got {stages}")


@lru_cache(maxsize=None)
def build(stages: int):
    """(the kernel, ptxas's report) at `stages` pipeline stages (compiled once per process)."""
    cubin, report = compile_cubin(SOURCE, (("STAGES", stages),))
    return CudaKernel(cubin, KERNEL, shared_bytes(stages)), report


def launch(grad_data: torch.Tensor, grad_scales: torch.Tensor, input_data: torch.Tensor, input_scales: torch.Tensor,
           offsets: torch.Tensor, target: torch.Tensor, mode: int, stages: int) -> None:
    """dW_e = dY_e^T X_e for every expert into `target` ([E, N, K] BF16 as int16 or fp32, or with
    ACCUMULATE_FP32 the int64 address table of each expert's fp32 [N, K]); operands as grouped_wgrad's."""
    n, k = grad_data.shape[0], input_data.shape[0]
    num_experts = offsets.numel() - 1
    for scales in (grad_scales, input_scales):
        if not scales.is_contiguous():
            raise ValueError("grouped_wgrad: the CUDA kernel copies contiguous block scales, got strides "
                             f"{scales.stride()}")
    if num_experts > MAX_EXPERTS or num_experts * n >= 2**31:
        raise ValueError(f"grouped_wgrad: the CUDA kernel takes up to {MAX_EXPERTS} experts and E * N below 2^31, got "
                         f"{num_experts} experts of N = {n}")
    device = grad_data.device
    num_tiles = num_experts * (n // FP8_BLOCK) * (k // FP8_BLOCK)
    grid = min(num_tiles, torch.cuda.get_device_properties(device).multi_processor_count)
    kernel, _ = build(stages)
    pointer = ctypes.c_uint64
    grad_map = tile_map(grad_data, FP8_BLOCK, FP8_BLOCK)
    # BF16 tiles leave through a map of the output as [E * N, K] (the other modes store from registers).
    out_map = tile_map(target.view(num_experts * n, k), FP8_BLOCK // 2, FP8_BLOCK // 2) if mode == STORE_BF16 \
        else grad_map
    kernel.launch(device, grid, THREADS, [
        grad_map, tile_map(input_data, FP8_BLOCK, FP8_BLOCK), out_map,
        pointer(grad_scales.data_ptr()), pointer(input_scales.data_ptr()), pointer(offsets.data_ptr()),
        pointer(target.data_ptr()), ctypes.c_int32(mode), ctypes.c_int32(num_experts), ctypes.c_int32(n),
        ctypes.c_int32(k)])
