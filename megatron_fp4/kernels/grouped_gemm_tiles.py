"""How one grouped FP8 GEMM launch runs: which kernels (GemmBackend) and at which tiles (GemmTiles).
Each backend's default tiles live beside its kernels (grouped_gemm_triton, grouped_gemm_sm90); the
front door (grouped_fp8_gemm) picks the backend and tiles when the caller leaves them to it."""

from dataclasses import dataclass
from enum import Enum


class GemmBackend(Enum):
    """The kernels of a grouped GEMM. All compute the same sums in the same order: the same bits."""

    # grouped_gemm_triton: any GPU Triton compiles for, and Triton's interpreter on the CPU.
    TRITON = "triton"
    # grouped_gemm_sm90: CUDA C++ (persistent, a producer warpgroup and two consumer warpgroups),
    # sm_90a machine code: Hopper GPUs only, the default there.
    CUDA_SM90 = "cuda_sm90"


@dataclass(frozen=True)
class GemmTiles:
    """Output tile, warps, pipeline stages, row tiles per L2 group and how operand tiles are loaded,
    of one grouped GEMM launch."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    # 1 or 2: with 2 the program's rows are two tiles of block_m / 2 that share each B tile, so
    # that a program loads fewer bytes per FLOP while one tensor-core product at a time is live.
    row_halves: int = 1
    # Operand tiles loaded by the Tensor Memory Accelerator (host-built tensor descriptors) instead
    # of per-thread pointer loads: the copies cost no registers or instructions of the program's
    # threads, and rows past the end of A read as zeros.
    tma: bool = False
