"""DeepGEMM as a measured peer of the experts' grouped FP8 GEMMs, on the operands our kernels take.

DeepGEMM (github.com/deepseek-ai/DeepGEMM; on a GPU machine see scripts/build_deepgemm.sh) is
optional: `load()` returns None, saying why, where `import deep_gemm` fails, and the benchmark then
measures without it. On SM90 its FP8 GEMMs take the same scaling as ours: activations in 1x128 blocks
(FP32 scales), weights in 128x128 blocks. What differs is the layout, converted here outside the
timed call (each conversion is one more pass over the operand, which a layer would have to pay or
fold into the pass that writes the operand):
- forward / data gradient (`m_grouped_fp8_gemm_nt_contiguous`): every expert's rows must start at a
  multiple of `get_mk_alignment_for_contiguous_layout()` rows; the padding rows (zero, marked -1 in
  the row-to-expert map) are computed like real ones. Rates count the real rows only, and the padding
  is reported.
- weight gradient (`k_grouped_fp8_gemm_nt_contiguous`): each expert's tokens as its own K-major block
  [N, tokens_e] back to back, where our column-wise operand is one [N, capacity] matrix; it adds the
  products to an FP32 [E, N, K] accumulator (as Megatron's main gradients).
- dense (`fp8_gemm_nt`): the second ceiling beside cuBLAS's scaled_mm.
Each peer's output is compared with ours on the same quantized operands (`relative_error`).
"""

import dataclasses
from typing import Callable, List, Optional, Tuple

import torch

from megatron_fp4.formats import FP8_BLOCK
from megatron_fp4.tensors import FP8BlockTensor, FP8StackedWeights

# Both sides multiply the same FP8 values with FP32 sums; they differ in summation order and in when
# the block scales are applied, then round to BF16 (relative step 2^-8). A Frobenius-relative error
# above this is a layout or scale mistake, not rounding.
AGREEMENT = 2.0 ** -8


def load():
    """The deep_gemm module, or None (printed: why) where it cannot be imported."""
    try:
        import deep_gemm
    except Exception as error:  # an ImportError, or an OSError from its compiled library
        print(f"  DeepGEMM not measured: import deep_gemm failed ({type(error).__name__}: {str(error)[:200]})")
        return None
    return deep_gemm


@dataclasses.dataclass(frozen=True)
class PeerCall:
    """One prepared DeepGEMM call: `run()` computes into `output()`; `useful_flops` counts real rows."""
    run: Callable[[], None]
    output: Callable[[], torch.Tensor]
    useful_flops: float
    padding_rows: int


def relative_error(mine: torch.Tensor, reference: torch.Tensor) -> float:
    """||mine - reference|| / ||reference||, in FP64."""
    mine, reference = mine.double(), reference.double()
    return float((mine - reference).norm() / reference.norm().clamp_min(1e-300))


def _aligned(count: int, alignment: int) -> int:
    return -(-count // alignment) * alignment


def rows_call(dg, rows: FP8BlockTensor, weights: FP8StackedWeights, counts: List[int]) -> PeerCall:
    """[M, N] = the experts' row segments times their weights^T, each segment copied to an aligned start."""
    alignment = int(dg.get_mk_alignment_for_contiguous_layout())
    num_rows, k = rows.shape
    n = weights.data.shape[1]
    padded_total = sum(_aligned(c, alignment) for c in counts)
    device = rows.data.device
    a = torch.zeros(padded_total, k, dtype=torch.float8_e4m3fn, device=device)
    # DeepGEMM reads the activation scales MN-major ([M, K/128] with unit stride along M), as ours are held.
    scales = torch.ones(k // FP8_BLOCK, padded_total, dtype=torch.float32, device=device)
    expert_of_row = torch.full((padded_total,), -1, dtype=torch.int32, device=device)
    real_rows = []
    source = destination = 0
    for expert, count in enumerate(counts):
        a[destination:destination + count] = rows.data[source:source + count]
        scales[:, destination:destination + count] = rows.block_scales[:, source:source + count]
        expert_of_row[destination:destination + count] = expert
        real_rows.append(torch.arange(destination, destination + count, device=device))
        source += count
        destination += _aligned(count, alignment)
    real_rows = torch.cat(real_rows)
    weight_scales = weights.block_scales[:, :, : k // FP8_BLOCK].contiguous()
    d = torch.empty(padded_total, n, dtype=torch.bfloat16, device=device)

    def run():
        dg.m_grouped_fp8_gemm_nt_contiguous((a, scales.t()), (weights.data, weight_scales), d, expert_of_row,
                                            disable_ue8m0_cast=True)
    return PeerCall(run, lambda: d[real_rows], 2.0 * num_rows * n * k, padded_total - num_rows)


def _per_expert_blocks(cols: FP8BlockTensor, offsets: List[int]) -> torch.Tensor:
    """The colwise operand [C, capacity] as DeepGEMM's K-grouped A/B: expert e's [C, tokens_e] block
    contiguous, the blocks back to back (flat)."""
    return torch.cat([cols.data[:, start:end].contiguous().view(-1) for start, end in zip(offsets, offsets[1:])])


def wgrad_call(dg, grad_cols: FP8BlockTensor, input_cols: FP8BlockTensor) -> PeerCall:
    """dW [E, N, K] += dY_e^T X_e over each expert's (128-padded) token segment, FP32 accumulator."""
    offsets = grad_cols.segment_offsets.tolist()
    if offsets != input_cols.segment_offsets.tolist():
        raise ValueError("the two colwise operands have different segments")
    ks = [end - start for start, end in zip(offsets, offsets[1:])]
    used = offsets[-1]
    n, k = grad_cols.shape[0], input_cols.shape[0]
    device = grad_cols.data.device
    a, b = _per_expert_blocks(grad_cols, offsets), _per_expert_blocks(input_cols, offsets)
    # [C, used/128] with unit stride along C: one scale per channel per 128 tokens, as ours are held.
    scale_a = grad_cols.block_scales[: used // FP8_BLOCK].t()
    scale_b = input_cols.block_scales[: used // FP8_BLOCK].t()
    ks_tensor = torch.tensor(ks, dtype=torch.int32, device=device)
    accumulator = torch.zeros(len(ks), n, k, dtype=torch.float32, device=device)

    def run():
        dg.k_grouped_fp8_gemm_nt_contiguous((a, scale_a), (b, scale_b), accumulator, ks, ks_tensor, accumulator)
    # The padding columns of each segment are zeros in our operand too: both compute them.
    return PeerCall(run, lambda: accumulator, 2.0 * used * n * k, 0)


def dense_call(dg, rows: FP8BlockTensor, weights: FP8StackedWeights) -> PeerCall:
    """All rows times expert 0's weight^T, as one dense GEMM (the ceiling beside cuBLAS's)."""
    num_rows, k = rows.shape
    weight = weights[0]
    n = weight.shape[0]
    d = torch.empty(num_rows, n, dtype=torch.bfloat16, device=rows.data.device)
    weight_scales = weight.scales().contiguous()

    def run():
        dg.fp8_gemm_nt((rows.data, rows.scaled_mm_scales()), (weight.data, weight_scales), d, disable_ue8m0_cast=True)
    return PeerCall(run, lambda: d, 2.0 * num_rows * n * k, 0)


def checked_rate(name: str, call: PeerCall, ours: Optional[torch.Tensor], time_ms: Callable[[Callable], float],
                 ) -> Tuple[Optional[float], Optional[float]]:
    """(TFLOP/s of the call on its real rows, its relative error against `ours` before any timing, None
    unchecked). The rate is None, said, where DeepGEMM refuses the call or disagrees with ours."""
    try:
        call.run()
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()  # a refusal raised inside the launch shows here
    except RuntimeError as error:
        print(f"  deepgemm {name}: not measured ({str(error).splitlines()[0][:200]})")
        return None, None
    error = None
    if ours is not None:
        error = relative_error(call.output(), ours)  # the timed runs below add to the wgrad accumulator
        print(f"  deepgemm {name}: relative error against ours {error:.2e} (bound {AGREEMENT:.1e}), "
              f"{call.padding_rows} padding rows computed")
        if not error <= AGREEMENT:
            print(f"  deepgemm {name}: disagrees with ours: not timed")
            return None, error
    return call.useful_flops / time_ms(call.run) / 1e9, error
