"""Expert-parallel all-to-all bytes one GPU sends per training step (rows to itself included; a
fraction (EP-1)/EP of them leave the GPU).

Per MoE layer and micro-batch a GPU sends its T tokens' rows four times: dispatch forward, dispatch
gradient in backward, combine forward, combine gradient in backward. How many rows per token
depends on the dispatcher:
- alltoall (Megatron's MoEAlltoAllTokenDispatcher, and ours): one row per routed (token, expert)
  pair, k*T rows;
- flex on DeepEP: one row per (token, destination rank), the rank's experts' outputs added before
  the combine sends it back: T times the expected number of distinct EP ranks among a token's
  top-k experts (`deepep_ranks_per_token`). Assumed: uniform routing, the k experts a uniformly
  random k-subset of the E experts (under group-limited routing, of the chosen groups' experts,
  where each group spans whole ranks), E/EP consecutive experts per rank. Real routing is skewed
  and correlated; the count is an expectation, not a bound.
Row sizes: BF16 2H bytes; MXFP4 H/2 + H/32 (packed E2M1 + one E8M0 scale per 32; through DeepEP the
same bytes as the codes [T, H/2] in its FP8 slot plus the scales packed four per float32 [T, H/128]);
FP8 1x128 H + H/32 (E4M3 + one fp32 scale per 128, DeepEP's own FP8 dispatch too). Megatron's
dispatchers send BF16 whatever the GEMM precision; --moe-fp4-dispatch sends MXFP4 forward and the
gradient in `moe_fp4_dispatch_grad` (bf16 or fp8; through DeepEP bf16 only, its combine being BF16);
combine stays BF16. With `moe` recompute the recompute runs the layer's forward again: a second
dispatch (unless the FP4 cache replays it: the paper's recipe, or --moe-fp4-cache) and a second
combine. The routing probabilities (4 bytes per row, DeepEP's top-k ids and weights per token) also
travel with the dispatch; they are left out here.
"""

from dataclasses import dataclass
from typing import Optional

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


def deepep_ranks_per_token(experts: int, topk: int, ep: int, groups: Optional[int] = None,
                           group_topk: Optional[int] = None) -> float:
    """Expected number of distinct EP ranks holding a token's top-k experts, the rows DeepEP sends per
    token (each rank once, whatever number of its experts the token chose): with m = E/EP experts
    per rank and the k experts a uniformly random k-subset of a pool of P experts on P/m ranks,
    (P/m) * (1 - C(P-m, k) / C(P, k)). The pool is every expert, or under group-limited routing
    (`moe_router_num_groups` / `moe_router_group_topk`) the chosen groups' experts where each group
    spans whole ranks (groups of consecutive experts, a multiple of m); groups smaller than a rank
    are not modelled (the pool stays every expert: more ranks than such routing reaches)."""
    if not experts or not topk:
        return 0.0
    if ep <= 1:
        return 1.0
    local = experts // ep
    pool = experts
    if groups and group_topk and experts % groups == 0 and (experts // groups) % local == 0:
        pool = group_topk * (experts // groups)
    if topk > pool:
        raise ValueError(f"top-{topk} routing over a pool of {pool} experts")
    none_here = 1.0
    for i in range(topk):  # C(P-m, k) / C(P, k): no chosen expert on a given rank of the pool
        none_here *= max(pool - local - i, 0) / (pool - i)
    return (pool // local) * (1.0 - none_here)


def moe_layers_on_rank(s: ModelShape, par: Parallel, rank: int) -> int:
    return sum(1 for chunk in par.chunks[rank] for kind, _ in chunk
               if kind == MOE or (kind == MTP and s.mtp_is_moe))


def a2a_bytes(s: ModelShape, par: Parallel, p: Precision, rc: Recompute, rank: int,
              deepep_ranks: Optional[float] = None) -> A2ABytes:
    """`deepep_ranks`: under the flex dispatcher on DeepEP, the rows per token
    (deepep_ranks_per_token); None: the alltoall dispatcher's k rows per token."""
    if not s.experts or par.ep == 1:
        return A2ABytes(0, 0, 0, 0, 0)
    per_token = s.topk if deepep_ranks is None else deepep_ranks
    rows = tokens_per_microbatch(s, par) * per_token / (par.tp if par.sequence_parallel else 1)
    n = moe_layers_on_rank(s, par, rank) * microbatches_per_step(s, par) * rows
    dispatch = row_bytes("fp4" if p.fp4_dispatch else "fp8" if p.fp8_dispatch else "bf16", s.hidden)
    bf16 = row_bytes("bf16", s.hidden)
    again = 0.0
    if "moe" in rc or rc.granularity == "full":  # (`moe_expert` recomputes no communication)
        again = bf16 + (0.0 if p.fp4_dispatch and p.fp4_cache else dispatch)
    return A2ABytes(dispatch_forward=n * dispatch, dispatch_backward=n * row_bytes(p.grad_wire, s.hidden),
                    combine_forward=n * bf16, combine_backward=n * bf16, recompute_forward=n * again)
