"""FP8 GEMMs one token segment at a time: a local expert's (ExpertGemms.PER_EXPERT; the grouped
kernels do all experts in one launch), or the one segment of a dense FP8 linear layer.

torch.nn.functional.scaled_mm with DeepSeek-style block scales (SM90, cuBLASLt >= 12.9):
activations and gradients in 1x128 blocks, weights in 128x128 blocks. No FP8 GEMM exists off the
GPU, so CPU tensors are refused unless a test installs an emulation in `scaled_mm_off_cuda`
(tests/support/scaled_mm_on_cpu.py): the operands, their layouts and the slicing stay the ones
the GPU uses, only the multiply-accumulate differs.

Operand conventions (scaled_mm's): a is [M, K] row-major with scales (M, K/128) of strides (1, M);
b is [K, N] column-major with scales (N, K/128) of strides (1, N) for 1x128, or
(round_up(K/128, 4), N/128) of strides (1, round_up(K/128, 4)) for 128x128.
"""

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..formats import FP8_BLOCK
from ..tensors import FP8BlockTensor, FP8BlockWeight, FP8StackedWeights


# cuBLASLt refuses block-scaled FP8 GEMMs whose M is not a multiple of 4 (CUBLAS_STATUS_NOT_SUPPORTED
# for M = 1, 70, 130; fine for 4, 8, 132: probed on H200, torch 2.11): each column of scale_a must
# start 16-byte aligned.
M_MULTIPLE = 4


def _padded_rows(start: int, end: int) -> int:
    return -(-(end - start) // M_MULTIPLE) * M_MULTIPLE


def rows_segment(t: FP8BlockTensor, start: int, end: int):
    """Rows [start, end) of a rowwise operand as (a, scale_a), M rounded up to a multiple of 4: the
    extra rows are the following tokens' (or zeros past the last token), and callers keep only the
    first end - start rows of the product. The scales are copied so that their leading stride is
    the segment's row count, as scaled_mm requires."""
    return rows_segments(t, [(start, end)])[0]


def rows_segments(t: FP8BlockTensor, bounds):
    """rows_segment for each (start, end) of `bounds`, the scale copies sharing one allocation
    (one per expert cost the experts' host loop an allocation and a fill launch each)."""
    groups = t.block_scales.shape[0]
    sizes = [_padded_rows(start, end) for start, end in bounds]
    # Each segment's [K/128, M] scales are a contiguous slice of one buffer: views, not .contiguous()
    # copies, which may keep an odd stride on a size-1 dimension (K = 128) that scaled_mm rejects.
    buffer = t.block_scales.new_empty(groups * sum(sizes))
    segments, offset = [], 0
    for (start, end), size in zip(bounds, sizes):
        scales = buffer[offset : offset + groups * size].view(groups, size)
        offset += groups * size
        segments.append(_segment_into(t, start, end, scales))
    return segments


def _segment_into(t: FP8BlockTensor, start: int, end: int, scales: torch.Tensor):
    padded_end = start + scales.shape[1]
    if padded_end <= t.data.shape[0]:
        scales.copy_(t.block_scales[:, start:padded_end])
        return t.data[start:padded_end], scales.t()
    scales[:, : end - start] = t.block_scales[:, start:end]
    scales[:, end - start :] = 1.0
    pad = t.data.new_zeros(padded_end - end, t.data.shape[1]).view(torch.uint8)
    data = torch.cat([t.data[start:end].view(torch.uint8), pad]).view(torch.float8_e4m3fn)
    return data, scales.t()


def columns_segment(t: FP8BlockTensor, start: int, end: int):
    """Columns [start, end) (128-aligned) of a colwise operand X^T [rows, capacity] as (a, scale_a):
    a [rows, end - start] with 1x128 blocks along its K = tokens."""
    return t.data[:, start:end], t.block_scales[start // FP8_BLOCK : end // FP8_BLOCK].t()


def columns_segment_as_b(t: FP8BlockTensor, start: int, end: int):
    """The same columns as scaled_mm's b: [end - start, rows] column-major (K = tokens, N = rows)."""
    data, scales = columns_segment(t, start, end)
    return data.t(), scales


def _check_contract(a, scale_a, b, scale_b, b_blocks_128x128: bool) -> None:
    """What scaled_mm (and cuBLASLt behind it) accepts on SM90, checked on every device so that
    the CPU tests catch a layout the GPU would refuse."""
    m, k = a.shape
    n = b.shape[1]
    problems = []
    if m % M_MULTIPLE or a.stride(1) != 1:
        problems.append(f"a must be row-major with M a multiple of {M_MULTIPLE}: shape {tuple(a.shape)} strides {a.stride()}")
    if tuple(scale_a.shape) != (m, k // FP8_BLOCK) or scale_a.stride() != (1, m):
        problems.append(f"scale_a must be ({m}, {k // FP8_BLOCK}) with strides (1, {m}): got "
                        f"{tuple(scale_a.shape)} {scale_a.stride()}")
    if b.shape[0] != k or b.stride(0) != 1:
        problems.append(f"b must be [{k}, N] column-major: shape {tuple(b.shape)} strides {b.stride()}")
    if b_blocks_128x128:
        rows = -(-(k // FP8_BLOCK) // 4) * 4
        expected = ((rows, n // FP8_BLOCK), (1, rows))
    else:
        expected = ((n, k // FP8_BLOCK), (1, n))
    if (tuple(scale_b.shape), scale_b.stride()) != expected:
        problems.append(f"scale_b must be {expected[0]} with strides {expected[1]}: got "
                        f"{tuple(scale_b.shape)} {scale_b.stride()}")
    if problems:
        raise RuntimeError("FP8 expert GEMM operands break scaled_mm's contract: " + "; ".join(problems))


def _scaled_mm_on_cuda(a, b, scale_a, recipe_a, scale_b, recipe_b, out_dtype,
                      out: Optional[torch.Tensor]) -> torch.Tensor:
    if out is None:
        return F.scaled_mm(a, b, scale_a, recipe_a, scale_b, recipe_b, output_dtype=out_dtype)
    # F.scaled_mm takes no `out`; the op behind it does (no [M, N] temporary and copy per expert).
    return torch.ops.aten._scaled_mm_v2.out(a, b, [scale_a], [recipe_a.value], [], [scale_b], [recipe_b.value], [],
                                            None, out_dtype, [], False, out=out)


# The GEMM for operands off CUDA, with _scaled_mm_on_cuda's arguments. None in production: tests
# running the experts on CPU install an emulation here.
scaled_mm_off_cuda: Optional[Callable[..., torch.Tensor]] = None


def _scaled_mm(a, b, scale_a, recipe_a, scale_b, recipe_b, out_dtype, out: Optional[torch.Tensor]) -> torch.Tensor:
    if a.is_cuda:
        return _scaled_mm_on_cuda(a, b, scale_a, recipe_a, scale_b, recipe_b, out_dtype, out)
    if scaled_mm_off_cuda is None:
        raise RuntimeError(f"the FP8 expert GEMMs need an SM90 (Hopper) GPU; the operands are on {a.device}")
    return scaled_mm_off_cuda(a, b, scale_a, recipe_a, scale_b, recipe_b, out_dtype, out)


def gemm_by_weight(a: torch.Tensor, scale_a: torch.Tensor, weight: FP8BlockWeight,
                   out_dtype=torch.bfloat16, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """a (1x128 blocks) @ weight.data^T (128x128 blocks): [M, K] x [K, N] with weight [N, K];
    written into `out` (contiguous [M, N] of out_dtype) when given."""
    b, scale_b = weight.scaled_mm_operand()
    _check_contract(a, scale_a, b, scale_b, b_blocks_128x128=True)
    return _scaled_mm(a, b, scale_a, F.ScalingType.BlockWise1x128, scale_b, F.ScalingType.BlockWise128x128,
                      out_dtype, out)


def gemm_1x128(a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor,
               out_dtype=torch.bfloat16) -> torch.Tensor:
    """a @ b with both operands in 1x128 blocks along K (the weight-gradient GEMMs)."""
    _check_contract(a, scale_a, b, scale_b, b_blocks_128x128=False)
    return _scaled_mm(a, b, scale_a, F.ScalingType.BlockWise1x128, scale_b, F.ScalingType.BlockWise1x128,
                      out_dtype, None)


def segment_products(segments, rows: FP8BlockTensor, weights: FP8StackedWeights, dtype) -> torch.Tensor:
    """[tokens, N]: each segment's rows times its weight ([N, K]), each GEMM writing straight into
    the result. A segment's M is padded to a multiple of 4 (rows_segments), so its last product rows
    spill into the next segment's, which the next segment's GEMM overwrites (they run in order), or
    into the spare rows past the end."""
    buffer = torch.empty(segments.num_tokens + M_MULTIPLE - 1, weights.data.shape[1], dtype=dtype,
                         device=rows.data.device)
    busy = list(segments.non_empty())
    operands = rows_segments(rows, [(first, end) for _, first, end, _, _ in busy])
    for (segment, first, *_), (a, scale_a) in zip(busy, operands):
        gemm_by_weight(a, scale_a, weights[segment], dtype, out=buffer[first : first + a.shape[0]])
    return buffer[: segments.num_tokens]


def segment_wgrad(segments, grad_cols: FP8BlockTensor, input_cols: FP8BlockTensor, dtype,
                  accumulate_into=None) -> Optional[torch.Tensor]:
    """grouped_wgrad's result ([E, N, K], zero for segments without tokens) one segment at a time;
    with accumulate_into (fp32 buffers) each segment's BF16 product is added there instead."""
    n, k = grad_cols.shape[0], input_cols.shape[0]
    out = None
    if accumulate_into is None:
        out = torch.zeros(len(segments.counts), n, k, dtype=dtype, device=grad_cols.data.device)
    for segment, _, _, col, col_end in segments.non_empty():
        product = gemm_1x128(*columns_segment(grad_cols, col, col_end),
                             *columns_segment_as_b(input_cols, col, col_end), dtype)
        if out is None:
            accumulate_into[segment].add_(product)
        else:
            out[segment].copy_(product)
    return out
