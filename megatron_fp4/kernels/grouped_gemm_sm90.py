"""The grouped FP8 GEMMs in CUDA C++ for Hopper (sm90/*.cu, GemmBackend.CUDA_SM90, the default on
SM90 GPUs): persistent CTAs of a producer warpgroup and two consumer warpgroups on tiles of 128 rows
and 128 or 256 columns, the same sums as the Triton kernels (grouped_gemm_triton). Called through
grouped_fp8_gemm, which checks the operands with the checks here."""

import ctypes
import dataclasses
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Dict

import torch

from ..formats import FP8_BLOCK
from ._cuda_runtime import SOURCES, CudaKernel, compile_cubin, tile_map
from .grouped_gemm_tiles import GemmTiles

THREADS = 3 * 128  # a producer warpgroup and two consumer warpgroups
MAX_EXPERTS = 1024  # per-expert tables live in shared memory (passed to the kernels' source)
SHARED_LIMIT = 227 * 1024  # what one block may ask for on Hopper
_ALIGNMENT = 1024  # the swizzled tiles start at 1024-byte boundaries
# The kernels' OutputMode.
STORE_BF16, STORE_FP32, ACCUMULATE_FP32 = 0, 1, 2


BLOCK_NS = (128, 256)  # output columns of a tile: one or two wgmma accumulators per consumer
GROUP_MS = range(1, 65)  # row tiles side by side in the tile order (any count works; 1 to 16 measured)

# 128 rows, three warpgroups, one CTA per SM; 128 or 256 columns. On H200 (rows in
# benchmarks/results/grouped_gemm.jsonl) three stages of 128 columns were the fastest or within a few
# percent of it for the weight gradients (256 columns lose 3-10% there) and for the forward / data
# gradients unless both N and K are >= 4096: tiles of 256 columns on two stages (half the bytes from
# L2 per B operand product) won fc1's forward (N 4096, K 7168) at 32 experts in every sweep, by up to
# 10%, and lost fc2's (N 7168, K 2048: 16 K steps a tile, too few to fill and drain two stages for) by
# 6-9% once the tiles went in groups of 4.
CUDA_TILES = GemmTiles(block_m=128, block_n=128, num_warps=12, num_stages=3, tma=True)
# Forward / data gradient: 4 row tiles side by side instead of 8. In-process A/B runs on H200 (same
# inputs, alternating rounds, equal bits): fc2's forward at 128 columns gained 13-17% (931 against 813
# TFLOP/s at 32 experts), fc2's data gradient 2-7%, fc1's forward at 256 columns 1-2%, fc1's data
# gradient -2% to +4%; groups of 1 and 2 were no better than 4. The weight gradient was the same at 4
# and 8 (within 2%), so it keeps 8.
CUDA_ROWS_TILES = dataclasses.replace(CUDA_TILES, group_m=4)
CUDA_WIDE_TILES = dataclasses.replace(CUDA_ROWS_TILES, block_n=256, num_stages=2)
WIDE_FROM = 4096  # N and K from which forward / data-gradient tiles are 256 columns wide


def rows_tiles(n: int, k: int) -> GemmTiles:
    """The forward / data-gradient tiles for an output of n columns and a reduction over k."""
    wide = n >= WIDE_FROM and k >= WIDE_FROM and n % CUDA_WIDE_TILES.block_n == 0
    return CUDA_WIDE_TILES if wide else CUDA_ROWS_TILES


@dataclass(frozen=True)
class Sm90Gemm:
    """One kernel: its source and name, and what its shared memory holds besides the operand tiles."""

    source: str
    name: str
    scales_in_stages: bool  # the weight gradient's stages also hold the step's row and column scales
    tile_counts: bool  # the rows kernel keeps the experts' running row-tile counts

    def stage_bytes(self, block_n: int) -> int:
        """A stage: the A tile (128 rows), the B tile (block_n rows), scales, two mbarriers."""
        scales = (FP8_BLOCK + block_n) * 4 if self.scales_in_stages else 0
        return FP8_BLOCK * FP8_BLOCK + block_n * FP8_BLOCK + scales + 16

    def shared_bytes(self, stages: int, block_n: int) -> int:
        """The stages, the BF16 output tile, the segment offsets [E + 1], the tile counts [E]."""
        other = FP8_BLOCK * block_n * 2 + 8 * (MAX_EXPERTS + 1) + (4 * MAX_EXPERTS if self.tile_counts else 0)
        return stages * self.stage_bytes(block_n) + other + _ALIGNMENT

    def stage_counts(self, block_n: int) -> range:
        return range(2, (SHARED_LIMIT - self.shared_bytes(0, block_n)) // self.stage_bytes(block_n) + 1)


WGRAD = Sm90Gemm("grouped_wgrad.cu", "grouped_wgrad_sm90", scales_in_stages=True, tile_counts=False)
ROWS = Sm90Gemm("grouped_rows.cu", "grouped_rows_sm90", scales_in_stages=False, tile_counts=True)


def check_fixed_tiles(name: str, tiles: GemmTiles) -> None:
    """Only the stages, the width and the row-tile groups of CUDA_TILES vary."""
    if tiles != dataclasses.replace(CUDA_TILES, num_stages=tiles.num_stages, block_n=tiles.block_n,
                                    group_m=tiles.group_m):
        raise ValueError(f"{name}: the CUDA kernel takes {CUDA_TILES} but for num_stages, block_n and group_m, got "
                         f"{tiles}")


def check_tiles(name: str, gemm: Sm90Gemm, stages: int, block_n: int, group_m: int) -> None:
    if block_n not in BLOCK_NS:
        raise ValueError(f"{name}: the CUDA kernel takes block_n {' or '.join(map(str, BLOCK_NS))}, got {block_n}")
    if group_m not in GROUP_MS:
        raise ValueError(f"{name}: the CUDA kernel takes group_m {GROUP_MS.start} to {GROUP_MS.stop - 1}, "
                         f"got {group_m}")
    counts = gemm.stage_counts(block_n)
    if stages not in counts:
        raise ValueError(f"{name}: the CUDA kernel takes {counts.start} to {counts.stop - 1} stages at block_n "
                         f"{block_n} ({gemm.stage_bytes(block_n)} bytes of shared memory each), got {stages}")


@lru_cache(maxsize=None)
def build(gemm: Sm90Gemm, stages: int, block_n: int, group_m: int):
    """(the kernel, ptxas's report) at `stages` pipeline stages, tiles of block_n columns and group_m
    row tiles side by side in the tile order (compiled once per process)."""
    defines = (("STAGES", stages), ("BLOCK_N", block_n), ("GROUP_M", group_m), ("MAX_EXPERTS", MAX_EXPERTS))
    cubin, report = compile_cubin(os.path.join(SOURCES, gemm.source), defines)
    return CudaKernel(cubin, gemm.name, gemm.shared_bytes(stages, block_n)), report


_TRITON_WAY = "the Triton kernels take it (GemmBackend.TRITON; ExpertGemms.GROUPED_TRITON for the experts)"


def check_operands(name: str, num_experts: int, sizes: Dict[str, int], *scales: torch.Tensor) -> None:
    """What the kernels need of the operands besides their tiles: 1 to MAX_EXPERTS experts (their tables
    live in shared memory), sizes that fit the kernels' 32-bit coordinates, and block scales contiguous
    and 16-byte aligned (the weight gradient's are bulk-copied)."""
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"{name}: the CUDA kernel takes 1 to {MAX_EXPERTS} experts, got {num_experts}; {_TRITON_WAY}")
    too_large = {what: size for what, size in sizes.items() if size >= 2**31}
    if too_large:
        raise ValueError(f"{name}: the CUDA kernel's coordinates are 32-bit, got {too_large}; {_TRITON_WAY}")
    for s in scales:
        if not s.is_contiguous() or s.data_ptr() % 16:
            raise ValueError(f"{name}: the CUDA kernel reads block scales contiguous and 16-byte aligned, got "
                             f"strides {s.stride()} at {s.data_ptr():#x}")


def check_device(name: str, device: torch.device) -> None:
    """The kernels are sm_90a machine code: an SM90 GPU."""
    if device.type != "cuda":
        raise RuntimeError(f"{name}: the CUDA kernel needs a GPU; pass backend=GemmBackend.TRITON on the CPU")
    if not is_sm90(device):
        raise RuntimeError(f"{name}: the CUDA kernel runs on Hopper (compute capability 9.0), found "
                           f"{torch.cuda.get_device_capability(device)}; {_TRITON_WAY}")


def is_sm90(device: torch.device) -> bool:
    return device.type == "cuda" and _capability(device) == (9, 0)


@lru_cache(maxsize=None)
def _capability(device: torch.device):
    return torch.cuda.get_device_capability(device)


def _grid(device: torch.device, tiles: int) -> int:
    return max(1, min(tiles, _multiprocessors(device)))


@lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _out_map(target: torch.Tensor, rows: int, cols: int, mode: int, unused):
    """BF16 tiles leave through a map of the output as [rows, cols] (the other modes store from registers
    and get `unused`)."""
    return tile_map(target.view(rows, cols), FP8_BLOCK // 2, FP8_BLOCK // 2) if mode == STORE_BF16 else unused


_pointer = ctypes.c_uint64
_int = ctypes.c_int32


def launch_wgrad(grad_data: torch.Tensor, grad_scales: torch.Tensor, input_data: torch.Tensor,
                 input_scales: torch.Tensor, offsets: torch.Tensor, target: torch.Tensor, mode: int,
                 stages: int, block_n: int, group_m: int) -> None:
    """dW_e = dY_e^T X_e for every expert into `target` ([E, N, K] BF16 as int16 or fp32, or with
    ACCUMULATE_FP32 the int64 address table of each expert's fp32 [N, K]); operands as grouped_wgrad's,
    checked by it (check_operands, check_device)."""
    n, k = grad_data.shape[0], input_data.shape[0]
    num_experts = offsets.numel() - 1
    grad_map = tile_map(grad_data, FP8_BLOCK, FP8_BLOCK)
    kernel, _ = build(WGRAD, stages, block_n, group_m)
    kernel.launch(grad_data.device, _grid(grad_data.device, num_experts * (n // FP8_BLOCK) * (k // block_n)),
                  THREADS, [
                      grad_map, tile_map(input_data, block_n, FP8_BLOCK),
                      _out_map(target, num_experts * n, k, mode, grad_map),
                      _pointer(grad_scales.data_ptr()), _pointer(input_scales.data_ptr()),
                      _pointer(offsets.data_ptr()), _pointer(target.data_ptr()), _int(mode), _int(num_experts),
                      _int(n), _int(k)])


def launch_rows(rows_data: torch.Tensor, row_scales: torch.Tensor, weight_data: torch.Tensor,
                weight_scales: torch.Tensor, offsets: torch.Tensor, target: torch.Tensor, mode: int,
                stages: int, block_n: int, group_m: int) -> None:
    """Y[rows of e] = X[rows of e] W_e^T into `target` ([M, N], BF16 as int16 or fp32); operands as
    grouped_gemm_by_weight's (weight_data [E, N, K]), checked by it (check_operands, check_device)."""
    m = rows_data.shape[0]
    num_experts, n, k = weight_data.shape
    rows_map = tile_map(rows_data, FP8_BLOCK, FP8_BLOCK)
    kernel, _ = build(ROWS, stages, block_n, group_m)
    upper_bound_tiles = (-(-m // FP8_BLOCK) + num_experts) * (n // block_n)
    kernel.launch(weight_data.device, _grid(weight_data.device, upper_bound_tiles), THREADS, [
        rows_map, tile_map(weight_data.view(num_experts * n, k), block_n, FP8_BLOCK),
        _out_map(target, m, n, mode, rows_map), _pointer(row_scales.data_ptr()), _pointer(weight_scales.data_ptr()),
        _pointer(offsets.data_ptr()), _pointer(target.data_ptr()), _int(mode), _int(num_experts), _int(m), _int(n),
        _int(k), _int(weight_scales.shape[2])])
