"""Expert-parallel all-to-all bytes one GPU sends per training step (rows to itself included; a
fraction (EP-1)/EP of them leave the GPU).

Per MoE layer and micro-batch a GPU sends k*T token rows four times: dispatch forward, dispatch
gradient in backward, combine forward, combine gradient in backward. Row sizes: BF16 2H bytes;
MXFP4 H/2 + H/32 (packed E2M1 + one E8M0 scale per 32); FP8 1x128 H + H/32 (E4M3 + one fp32 scale
per 128). Megatron's alltoall dispatcher sends BF16 whatever the GEMM precision; --moe-fp4-dispatch
sends MXFP4 forward and the gradient in `moe_fp4_dispatch_grad` (bf16 or fp8); combine stays BF16.
With `moe` recompute the recompute runs the layer's forward again: a second dispatch (unless the
FP4 cache replays it: the paper's recipe, or --moe-fp4-cache) and a second combine. The routing
probabilities (4 bytes per row) also travel with the dispatch; they are left out here.
"""

from dataclasses import dataclass

from .precision import FP8_1X128_BYTES, MXFP4_BYTES, Precision
from .recompute import Recompute
from .shapes import (
    MOE,
    MTP,
    ModelShape,
    Parallel,
    microbatches_per_step,
    tokens_per_microbatch,
)


def row_bytes(fmt: str, hidden: int) -> float:
    if fmt == "fp4":
        return hidden * MXFP4_BYTES
    if fmt == "fp8":
        return hidden * FP8_1X128_BYTES
    if fmt == "bf16":
        return 2 * hidden
    raise ValueError(f"unknown wire format {fmt!r}")


@dataclass(frozen=True)
class A2ABytes:
    dispatch_forward: float
    dispatch_backward: float
    combine_forward: float
    combine_backward: float
    recompute_forward: float  # the second dispatch and combine of `moe` recompute

    @property
    def total(self) -> float:
        return (self.dispatch_forward + self.dispatch_backward + self.combine_forward + self.combine_backward
                + self.recompute_forward)


def moe_layers_on_rank(s: ModelShape, par: Parallel, rank: int) -> int:
    return sum(1 for chunk in par.chunks[rank] for kind, _ in chunk
               if kind == MOE or (kind == MTP and s.mtp_is_moe))


def a2a_bytes(s: ModelShape, par: Parallel, p: Precision, rc: Recompute, rank: int) -> A2ABytes:
    if not s.experts or par.ep == 1:
        return A2ABytes(0, 0, 0, 0, 0)
    rows = tokens_per_microbatch(s, par) * s.topk / (par.tp if par.sequence_parallel else 1)
    n = moe_layers_on_rank(s, par, rank) * microbatches_per_step(s, par) * rows
    dispatch = row_bytes("fp4" if p.fp4_dispatch else "fp8" if p.fp8_dispatch else "bf16", s.hidden)
    bf16 = row_bytes("bf16", s.hidden)
    again = 0.0
    if "moe" in rc or rc.granularity == "full":  # (`moe_expert` recomputes no communication)
        again = bf16 + (0.0 if p.fp4_dispatch and p.fp4_cache else dispatch)
    return A2ABytes(dispatch_forward=n * dispatch, dispatch_backward=n * row_bytes(p.grad_wire, s.hidden),
                    combine_forward=n * bf16, combine_backward=n * bf16, recompute_forward=n * again)
