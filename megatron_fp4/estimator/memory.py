"""Per-GPU peak memory: for every pipeline rank, static memory + the saved activations of the
micro-batches it holds at the worst point of the schedule + a transient allowance; the estimate is
the rank with the largest peak.

Transient allowance (one rule for every config, derived from the same inventory, not tuned):
while a layer runs its backward, its MLP or attention backward's working set
(activations.backward_working_set), less what the chunk's backward has freed before it (the head's,
the later layers' saved tensors; memory._backward_transient), for the worst layer on the rank; on
the rank that computes the loss, also the logits in the model dtype while the cross entropy holds
its fp32 copy.
"""

from dataclasses import dataclass, field

from . import activations as act
from . import wgrad_buffers
from .params import rank_params
from .precision import Precision
from .recompute import Recompute
from .schedule import peak_held
from .shapes import (
    DENSE,
    EMBEDDING,
    LOSS,
    MOE,
    MTP,
    ModelShape,
    Parallel,
    microbatches_per_step,
    tokens_per_microbatch,
)
from .static import Static, static_memory


@dataclass
class RankMemory:
    rank: int
    static: Static
    activations: float  # saved activations of the held micro-batches
    transient: float
    held: list[int]  # micro-batches held per model chunk at the worst point
    chunk_bytes: list[float]  # one micro-batch's saved activations per chunk
    components: dict[str, float] = field(default_factory=dict)  # one micro-batch, whole rank
    held_components: dict[str, float] = field(default_factory=dict)  # `activations` by component

    @property
    def peak(self) -> float:
        return self.static.total + self.activations + self.transient


def chunk_activations(c: act.Ctx, chunk) -> dict[str, float]:
    """One micro-batch's saved activations of one model chunk, by component."""
    out: dict[str, float] = {}

    def add(parts: dict, prefix: str = ""):
        for key, value in parts.items():
            out[prefix + key] = out.get(prefix + key, 0) + value

    for kind, _ in chunk:
        if kind in (DENSE, MOE):
            add(act.layer(c, kind), f"{kind}.")
        elif kind == MTP:
            add(act.layer(c, MOE if c.s.mtp_is_moe else DENSE), "mtp.")
            add(act.mtp_extras(c), "mtp.")
        elif kind == LOSS:
            add(act.head(c, 1 + c.s.mtp_layers), "head.")
        elif kind == EMBEDDING:
            out["embedding.token_ids"] = c.tokens * 8
    return out


def _layer_kind(c: act.Ctx, kind: str) -> str | None:
    """The transformer layer a chunk entry runs (an MTP layer's is dense or MoE), or None."""
    if kind == MTP:
        return MOE if c.s.mtp_is_moe else DENSE
    return kind if kind in (DENSE, MOE) else None


def _backward_transient(c: act.Ctx, chunk) -> float:
    """The largest layer backward working set of the chunk, less what its backward has freed by
    then: the chunk runs backward from its end, the head's saved tensors go first, an MTP layer's
    final-norm input before its transformer layer, and each layer's saved tensors after it, so the
    first layer in backward order usually sets the peak. While MTP layers run backward, the hidden
    states' gradient waits (act.mtp_hidden_gradient)."""
    working_set, saved = {}, {}
    freed = worst = 0.0
    for kind, _ in reversed(chunk):
        if kind == LOSS:
            freed += sum(act.head(c, 1 + c.s.mtp_layers).values())
        layer_kind = _layer_kind(c, kind)
        if layer_kind is None:
            continue
        if layer_kind not in working_set:
            working_set[layer_kind] = act.backward_working_set(c, layer_kind)
            saved[layer_kind] = sum(act.layer(c, layer_kind).values())
        extras = act.mtp_extras(c) if kind == MTP else {}
        freed += extras.pop("mtp_final_norm_in", 0.0)  # the MTP final norm's backward runs first
        waiting = act.mtp_hidden_gradient(c) if kind == MTP else 0.0
        worst = max(worst, working_set[layer_kind] + waiting - freed)
        freed += saved[layer_kind] + sum(extras.values())
    return worst


def chunk_transients(c: act.Ctx, chunk) -> tuple:
    """(at the end of a forward, during a backward) of this chunk: the layers' backward working set
    (_backward_transient); with the loss, the model-dtype logits during the cross entropy (forward
    and the start of backward)."""
    layers = _backward_transient(c, chunk)
    if not any(kind == LOSS for kind, _ in chunk):
        return 0.0, layers
    logits = act.logits_transient(c)
    return logits, max(logits, layers)


def rank_memory(args, c: act.Ctx, rank: int, workspace: float) -> RankMemory:
    s, par = c.s, c.par
    chunks = par.chunks[rank]
    parts = [chunk_activations(c, chunk) for chunk in chunks]
    chunk_bytes = [sum(p.values()) for p in parts]
    extras = [chunk_transients(c, chunk) for chunk in chunks]
    held_bytes, transient, held = peak_held(
        chunk_bytes, par.pp, rank, microbatches_per_step(s, par),
        getattr(args, "microbatch_group_size_per_vp_stage", None) or par.pp,
        forward_extra=[e[0] for e in extras], backward_extra=[e[1] for e in extras])
    counts = rank_params(s, par, rank, c.bias, c.p.fp8_linear_roles)
    static = static_memory(args, counts, c.p, par.dp, par.edp, workspace,
                           wgrad_buffers.persistent_bytes(s, par, c.p, chunks))
    components: dict[str, float] = {}
    held_components: dict[str, float] = {}
    for p, n in zip(parts, held):
        for key, value in p.items():
            components[key] = components.get(key, 0) + value
            held_components[key] = held_components.get(key, 0) + n * value
    return RankMemory(rank, static, held_bytes, transient, held, chunk_bytes, components, held_components)


def make_ctx(args, s: ModelShape, par: Parallel, p: Precision, rc: Recompute) -> act.Ctx:
    rope = args.position_embedding_type in ("rope", "yarn", "mrope")
    if getattr(args, "cross_entropy_loss_fusion", False) and args.cross_entropy_fusion_impl == "te":
        ce_bytes = p.model_bytes  # Transformer Engine's kernel keeps the gradient in the logits' dtype
    else:
        ce_bytes = 4  # Megatron's (fused or not) keeps the fp32 softmax
    softmax_fp32 = bool(args.attention_softmax_in_fp32 or args.apply_query_key_layer_scaling)
    return act.Ctx(s=s, par=par, p=p, rc=rc, tokens=tokens_per_microbatch(s, par), rope=rope,
                   softmax_fp32=softmax_fp32, ce_bytes=ce_bytes, bias=bool(args.add_bias_linear))


def workspace_bytes(c: act.Ctx) -> float:
    """Megatron's local (unfused) attention takes its [b*heads, s, s] score buffer from a global
    buffer that is allocated once and kept."""
    if c.s.fused_attention:
        return 0.0
    s = c.s.seq_length // c.par.cp
    return c.s.micro_batch * c.s.heads / c.par.tp * s * s * c.p.model_bytes


def all_ranks(args, c: act.Ctx) -> list[RankMemory]:
    workspace = workspace_bytes(c)
    return [rank_memory(args, c, rank, workspace) for rank in range(c.par.pp)]
