"""Grouped FP8 GEMMs over the local experts' ragged token segments: one launch per GEMM.

Block scales as DeepSeek-V3 trains with them: activations and gradients in 1x128 blocks, weights
in 128x128 blocks. Every K step of 128 is one scaled product: the tile's FP8 product, accumulated in
fp32 by the tensor cores, is multiplied by the row scale times the column scale and added to an fp32
accumulator (the "promotion" DeepGEMM does; cuBLASLt's blockwise GEMM computes the same sum).

- `grouped_gemm_by_weight` (fprop, dgrad): Y[rows of expert e] = X[rows of e] W_e^T, X [M, K] in
  1x128 rows, W [E, N, K] in 128x128 blocks.
- `grouped_wgrad`: dW_e [N, K] = dY_e^T X_e for every expert, both operands colwise (1x128 along
  the tokens, each segment starting at a multiple of 128 columns and zero-filled past its tokens,
  as the column kernels write them). An expert without tokens gets a zero gradient.

This is the front door: it checks the operands and launches one backend's kernels (GemmBackend:
grouped_gemm_triton, grouped_gemm_sm90), the CUDA kernels on SM90 GPUs and the Triton kernels
elsewhere unless the caller names one; each backend's tiles default to its own.
"""

from typing import Optional, Sequence

import torch

from ..formats import FP8_BLOCK
from ..tensors import COLWISE, ROWWISE, FP8BlockTensor, FP8StackedWeights
from ._addresses import address_table
from ._checks import check_contiguous, check_kernel_device, check_segment_offsets
from . import grouped_gemm_sm90, grouped_gemm_triton
from .grouped_gemm_tiles import GemmBackend, GemmTiles


def default_backend(device: torch.device) -> GemmBackend:
    """The CUDA kernels on an SM90 GPU (they are sm_90a machine code), else the Triton kernels (other
    GPUs, and the CPU interpreter)."""
    return GemmBackend.CUDA_SM90 if grouped_gemm_sm90.is_sm90(device) else GemmBackend.TRITON


def _backend(name: str, backend: Optional[GemmBackend], device: torch.device) -> GemmBackend:
    if backend is None:
        return default_backend(device)
    if not isinstance(backend, GemmBackend):
        raise TypeError(f"{name}: backend must be a GemmBackend, got {backend!r}")
    return backend


def default_rows_tiles(backend: GemmBackend, n: int, k: int) -> GemmTiles:
    """The forward / data-gradient tiles of `backend` for an output of n columns and a reduction over k
    (the CUDA tiles are 256 wide where both are >= grouped_gemm_sm90.WIDE_FROM)."""
    if backend is GemmBackend.CUDA_SM90:
        return grouped_gemm_sm90.rows_tiles(n, k)
    return grouped_gemm_triton.DEFAULT_ROWS_TILES


def default_wgrad_tiles(backend: GemmBackend) -> GemmTiles:
    if backend is GemmBackend.CUDA_SM90:
        return grouped_gemm_sm90.CUDA_TILES
    return grouped_gemm_triton.DEFAULT_WGRAD_TILES


def _check_tiles(name: str, backend: GemmBackend, tiles: GemmTiles, n: int, k: int) -> None:
    """Tiles the backend takes for an output of n columns and a reduction over k (k: the forward's K, or
    the weight gradient's output columns, its K)."""
    if backend is GemmBackend.CUDA_SM90:
        grouped_gemm_sm90.check_fixed_tiles(name, tiles)
    else:
        grouped_gemm_triton.check_tiles(name, tiles)
    if n % FP8_BLOCK or k % FP8_BLOCK:
        raise ValueError(f"{name}: N {n} and K {k} must be multiples of {FP8_BLOCK}")


def grouped_gemm_by_weight(rows: FP8BlockTensor, weights: FP8StackedWeights, row_offsets: torch.Tensor,
                           out_dtype=torch.bfloat16, tiles: Optional[GemmTiles] = None,
                           backend: Optional[GemmBackend] = None, check_offsets: bool = True) -> torch.Tensor:
    """[M, N]: rows [row_offsets[e], row_offsets[e + 1]) of `rows` (1x128, [M, K]) times weights[e]^T
    (128x128, [N, K]) for every expert e. row_offsets: int64 [E + 1] on the rows' device, from 0 to M,
    never decreasing. backend: default_backend(device) when None; tiles: default_rows_tiles(backend, N,
    K) when None. check_offsets: assert row_offsets' values on the device (_checks.check_segment_offsets:
    no host sync, a few small launches); a caller whose offsets are right by construction may skip it."""
    name = "grouped_gemm_by_weight"
    if not isinstance(rows, FP8BlockTensor) or rows.layout != ROWWISE:
        raise TypeError(f"{name}: expected a rowwise FP8BlockTensor")
    if not isinstance(weights, FP8StackedWeights):
        raise TypeError(f"{name}: expected FP8StackedWeights, got {type(weights).__name__}")
    check_kernel_device(name, rows.data)
    check_contiguous(name, "rows.block_scales", rows.block_scales)
    num_rows, k = rows.shape
    num_experts, n, weight_k = weights.data.shape
    if weight_k != k:
        raise ValueError(f"{name}: the rows have K = {k}, the weights {weight_k}")
    _check_row_offsets(name, row_offsets, num_experts, rows.data.device, num_rows, check_offsets)
    backend = _backend(name, backend, rows.data.device)
    tiles = default_rows_tiles(backend, n, k) if tiles is None else tiles
    _check_tiles(name, backend, tiles, n, k)
    if n % tiles.block_n:
        raise ValueError(f"{name}: N {n} must be a multiple of block_n {tiles.block_n}")
    if backend is GemmBackend.CUDA_SM90:
        _check_cuda_launch(name, tiles, grouped_gemm_sm90.ROWS, num_experts,
                           {"M": num_rows, "E * N": num_experts * n, "K": k}, (rows.data, weights.data),
                           (rows.block_scales, weights.block_scales), out_dtype)
    out = torch.empty(num_rows, n, dtype=out_dtype, device=rows.data.device)
    if num_rows == 0:
        return out
    if backend is GemmBackend.CUDA_SM90:
        grouped_gemm_sm90.launch_rows(rows.data, rows.block_scales, weights.data, weights.block_scales, row_offsets,
                                      _stored(out), _cuda_output_mode(name, out_dtype), tiles.num_stages,
                                      tiles.block_n, tiles.group_m)
        return out
    _check_operand(name, rows.data, tiles.tma)
    _check_operand(name, weights.data, tiles.tma)
    grouped_gemm_triton.launch_rows(rows, weights, row_offsets, _stored(out), out_dtype == torch.bfloat16, tiles)
    return out


def grouped_wgrad(grad_cols: FP8BlockTensor, input_cols: FP8BlockTensor, out_dtype=torch.bfloat16,
                  accumulate_into: Optional[Sequence[torch.Tensor]] = None, tiles: Optional[GemmTiles] = None,
                  backend: Optional[GemmBackend] = None, check_offsets: bool = True) -> Optional[torch.Tensor]:
    """[E, N, K]: for every expert, its columns of grad_cols ([N, capacity], dY^T) times the same
    columns of input_cols ([K, capacity], X^T) transposed; both colwise with the same segments.
    With accumulate_into (one contiguous fp32 [N, K] per expert) the fp32 sums are added there
    instead, and nothing is returned. backend: default_backend(device) when None; tiles:
    default_wgrad_tiles(backend) when None. check_offsets: assert on the device (no host sync) that
    the operands' segment offsets are equal, multiples of 128, from 0, never decreasing and within the
    capacity (_checks.check_segment_offsets); the column kernels write them so, and a caller passing
    their outputs may skip it."""
    name = "grouped_wgrad"
    for operand in (grad_cols, input_cols):
        if not isinstance(operand, FP8BlockTensor) or operand.layout != COLWISE:
            raise TypeError(f"{name}: expected colwise FP8BlockTensors")
    check_kernel_device(name, grad_cols.data)
    check_contiguous(name, "grad_cols.block_scales", grad_cols.block_scales)
    check_contiguous(name, "input_cols.block_scales", input_cols.block_scales)
    backend = _backend(name, backend, grad_cols.data.device)
    tiles = default_wgrad_tiles(backend) if tiles is None else tiles
    n, capacity = grad_cols.shape
    k, input_capacity = input_cols.shape
    if input_capacity != capacity:
        raise ValueError(f"{name}: the operands' token columns differ ({capacity} and {input_capacity})")
    # Both come from the same segments (the experts' counts): compared on the device, as the rest.
    offsets = grad_cols.segment_offsets
    entries = offsets.numel() if isinstance(offsets, torch.Tensor) else 0
    check_segment_offsets(name, "grad_cols.segment_offsets", offsets, entries, grad_cols.data.device, capacity,
                          exact_end=False, multiple_of=FP8_BLOCK,
                          same_as=("input_cols.segment_offsets", input_cols.segment_offsets), on_device=check_offsets)
    if n % tiles.block_m or k % tiles.block_n:
        raise ValueError(f"{name}: N {n} must be a multiple of block_m {tiles.block_m} and K {k} of block_n "
                         f"{tiles.block_n}")
    num_experts = entries - 1
    if backend is GemmBackend.CUDA_SM90:
        _check_tiles(name, backend, tiles, n, k)
        _check_cuda_launch(name, tiles, grouped_gemm_sm90.WGRAD, num_experts,
                           {"capacity": capacity, "E * N": num_experts * n, "K": k},
                           (grad_cols.data, input_cols.data), (grad_cols.block_scales, input_cols.block_scales),
                           out_dtype if accumulate_into is None else None)
    if accumulate_into is None:
        out = torch.empty(num_experts, n, k, dtype=out_dtype, device=grad_cols.data.device)
        target = _stored(out)
    else:
        _check_accumulators(name, accumulate_into, num_experts, (n, k), grad_cols.data.device)
        out, target = None, address_table(name, accumulate_into)
    if capacity == 0:  # no token at all: zero gradients (nothing to add); a TMA descriptor needs a width
        return None if out is None else out.zero_()
    if backend is GemmBackend.CUDA_SM90:
        mode = grouped_gemm_sm90.ACCUMULATE_FP32 if out is None else _cuda_output_mode(name, out_dtype)
        grouped_gemm_sm90.launch_wgrad(grad_cols.data, grad_cols.block_scales, input_cols.data,
                                       input_cols.block_scales, offsets, target, mode, tiles.num_stages,
                                       tiles.block_n, tiles.group_m)
        return out
    _check_operand(name, grad_cols.data, tiles.tma)
    _check_operand(name, input_cols.data, tiles.tma)
    grouped_gemm_triton.launch_wgrad(grad_cols, input_cols, target, accumulate_into is not None,
                                     out_dtype == torch.bfloat16, tiles)
    return out


def _check_cuda_launch(name: str, tiles: GemmTiles, gemm, num_experts: int, sizes, operands, scales,
                       out_dtype: Optional[torch.dtype]) -> None:
    """What the CUDA kernels need (tiles, operands that tensor maps can read, scales, sizes, the output
    dtype, None when adding into fp32 buffers), then an SM90 GPU."""
    grouped_gemm_sm90.check_tiles(name, gemm, tiles.num_stages, tiles.block_n, tiles.group_m)
    for data in operands:
        _check_operand(name, data, True)
    grouped_gemm_sm90.check_operands(name, num_experts, sizes, *scales)
    if out_dtype is not None:
        _cuda_output_mode(name, out_dtype)
    grouped_gemm_sm90.check_device(name, operands[0].device)


def _cuda_output_mode(name: str, out_dtype: torch.dtype) -> int:
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"{name}: the CUDA kernel writes BF16 or fp32, got {out_dtype}")
    return grouped_gemm_sm90.STORE_BF16 if out_dtype == torch.bfloat16 else grouped_gemm_sm90.STORE_FP32


def _check_operand(name: str, data: torch.Tensor, tma: bool) -> None:
    """Every kernel reads an FP8 operand as a contiguous matrix (its row stride is its width); TMA
    also needs a 16-byte aligned address."""
    if not data.is_contiguous():
        raise ValueError(f"{name}: the FP8 operands must be contiguous, got shape {tuple(data.shape)} with strides "
                         f"{data.stride()}")
    if tma and data.data_ptr() % 16:
        raise ValueError(f"{name}: TMA tiles need FP8 operands at 16-byte aligned addresses, got one at "
                         f"{data.data_ptr():#x}; pass tiles with tma=False")


def _stored(out: torch.Tensor) -> torch.Tensor:
    """The output as the kernels write it: BF16 as int16 bits rounded to nearest even by the kernel
    (Triton's interpreter truncates in .to(tl.bfloat16), the GPU rounds: the bits agree on both)."""
    return out.view(torch.int16) if out.dtype == torch.bfloat16 else out


def _check_accumulators(name: str, buffers: Sequence[torch.Tensor], num_experts: int, shape, device) -> None:
    if len(buffers) != num_experts:
        raise ValueError(f"{name}: {len(buffers)} accumulation buffers for {num_experts} experts")
    for buffer in buffers:
        if buffer.dtype != torch.float32 or tuple(buffer.shape) != tuple(shape) or not buffer.is_contiguous() \
                or buffer.device != device:
            raise ValueError(f"{name}: each accumulation buffer must be a contiguous fp32 {list(shape)} on {device}, "
                             f"got {buffer.dtype} {tuple(buffer.shape)} on {buffer.device}")


def _check_row_offsets(name: str, offsets, num_experts: int, device, num_rows: int, on_device: bool) -> None:
    """row_offsets of the forward / data-gradient GEMMs: int64 [E + 1], from 0 to M, never decreasing
    (rows past a wrong end would be left unwritten, or written out of bounds)."""
    check_segment_offsets(name, "row_offsets", offsets, num_experts + 1, device, num_rows, on_device=on_device)
