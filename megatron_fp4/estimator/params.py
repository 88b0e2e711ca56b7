"""Parameter counts from the shapes, per pipeline rank, split the ways the memory depends on:
dense parameters (replicated over TP-complement data parallelism, optimizer sharded over DP) vs
routed-expert parameters (optimizer sharded over expert data parallelism), and which weights feed
FP8 GEMMs (Transformer Engine keeps FP8 copies of those).

Counts follow the modules Megatron-Core builds (megatron/core/transformer/*): biases only with
add_bias_linear, RMSNorm has a weight, LayerNorm a weight and a bias.

Our FP8 linears (--moe-fp4-linears fp8, TP 1) keep FP8 copies of their weights padded to multiples
of 128 in both dimensions (MLA's kv down-projection: 576 output features -> 640):
`fp8_linear_padded` counts those padded elements.
"""

from dataclasses import dataclass

from ..formats import FP8_BLOCK
from .shapes import DENSE, EMBEDDING, LOSS, MOE, MTP, ModelShape, Parallel


@dataclass
class ParamCount:
    dense: float = 0.0  # parameters whose optimizer state is sharded over DP
    expert: float = 0.0  # routed-expert parameters: optimizer state sharded over expert-DP
    dense_gemm: float = 0.0  # of `dense`: weights of Transformer Engine GEMMs (FP8 copies under FP8)
    expert_gemm: float = 0.0
    fp8_linear: float = 0.0  # of `dense_gemm`: weights of the linears --moe-fp4-linears fp8 replaces
    fp8_linear_padded: float = 0.0  # the same, padded to 128 x 128 blocks (their FP8 copies' elements)

    def __iadd__(self, other):
        self.dense += other.dense
        self.expert += other.expert
        self.dense_gemm += other.dense_gemm
        self.expert_gemm += other.expert_gemm
        self.fp8_linear += other.fp8_linear
        self.fp8_linear_padded += other.fp8_linear_padded
        return self

    @property
    def total(self) -> float:
        return self.dense + self.expert


def _gemm(n: float) -> ParamCount:
    return ParamCount(dense=n, dense_gemm=n)


def _plain(n: float) -> ParamCount:
    return ParamCount(dense=n)


def _padded(n: int) -> int:
    return -(-n // FP8_BLOCK) * FP8_BLOCK


def fp8_linear_shapes(s: ModelShape, kind: str) -> list[tuple[int, int]]:
    """(output features, input features) of each linear of one decoder layer that our FP8 linears
    replace (TP 1): the attention projections, the dense MLP's fc1 / fc2 or the shared experts'."""
    h = s.hidden
    if s.mla:
        q_head = s.qk_head_dim + s.qk_rope_dim
        q = [(s.q_lora_rank, h), (s.heads * q_head, s.q_lora_rank)] if s.q_lora_rank else [(s.heads * q_head, h)]
        out = q + [(s.kv_lora_rank + s.qk_rope_dim, h), (s.heads * (s.qk_head_dim + s.v_head_dim), s.kv_lora_rank),
                   (h, s.heads * s.v_head_dim)]
    else:
        out = [((s.heads + 2 * s.query_groups) * s.head_dim, h), (h, s.heads * s.head_dim)]
    ffn = s.ffn_hidden if kind == DENSE else s.shared_ffn_hidden
    if ffn:
        out += [(s.fc1_factor * ffn, h), (h, ffn)]
    return out


def fp8_linear_copy_elements(shape: tuple[int, int]) -> int:
    """Elements of one FP8 copy (W or W^T) of a linear's weight, both dimensions padded to 128."""
    return _padded(shape[0]) * _padded(shape[1])


def _fp8_linears(s: ModelShape, kind: str) -> ParamCount:
    shapes = fp8_linear_shapes(s, kind)
    return ParamCount(fp8_linear=sum(n * k for n, k in shapes),
                      fp8_linear_padded=sum(fp8_linear_copy_elements(x) for x in shapes))


def attention_params(s: ModelShape, tp: int, bias: bool) -> ParamCount:
    h = s.hidden
    out = ParamCount()
    if s.mla:
        q_head = s.qk_head_dim + s.qk_rope_dim
        if s.q_lora_rank:
            out += _gemm(h * s.q_lora_rank)  # q down (not split over TP)
            if s.qk_layernorm:
                out += _plain(s.q_lora_rank * s.norm_params)  # q layernorm
            out += _gemm(s.q_lora_rank * s.heads * q_head / tp)  # q up
        else:
            out += _gemm(h * s.heads * q_head / tp)
        out += _gemm(h * (s.kv_lora_rank + s.qk_rope_dim))  # kv down
        if s.qk_layernorm:
            out += _plain(s.kv_lora_rank * s.norm_params)  # kv layernorm
        out += _gemm(s.kv_lora_rank * s.heads * (s.qk_head_dim + s.v_head_dim) / tp)  # kv up
        out += _gemm(s.heads * s.v_head_dim * h / tp)  # output projection
        return out
    qkv = (s.heads + 2 * s.query_groups) * s.head_dim
    out += _gemm(h * qkv / tp)
    out += _gemm(s.heads * s.head_dim * h / tp)
    if bias:
        out += _plain(qkv / tp + h)
    return out


def mlp_params(h: int, ffn: int, factor: int, tp: int, bias: bool) -> ParamCount:
    out = _gemm((h * factor * ffn + ffn * h) / tp)
    if bias:
        out += _plain(factor * ffn / tp + h)
    return out


def layer_params(s: ModelShape, par: Parallel, kind: str, bias: bool) -> ParamCount:
    h = s.hidden
    out = attention_params(s, par.tp, bias)
    out += _plain(2 * h * s.norm_params)  # input and pre-MLP layer norms
    out += _fp8_linears(s, kind)
    if kind == DENSE:
        out += mlp_params(h, s.ffn_hidden, s.fc1_factor, par.tp, bias)
        return out
    out += _plain(s.experts * h)  # router
    if s.shared_ffn_hidden:
        out += mlp_params(h, s.shared_ffn_hidden, s.fc1_factor, par.tp, bias)
    routed = s.experts * (h * s.fc1_factor * s.moe_ffn_hidden + s.moe_ffn_hidden * h) / par.local_experts_divisor
    out += ParamCount(expert=routed, expert_gemm=routed)
    return out


def mtp_params(s: ModelShape, par: Parallel, bias: bool) -> ParamCount:
    out = _plain(3 * s.hidden * s.norm_params)  # enorm, hnorm, final layernorm
    out += _gemm(2 * s.hidden * s.hidden / par.tp)  # eh_proj
    out += layer_params(s, par, MOE if s.mtp_is_moe else DENSE, bias)
    return out


def rank_params(s: ModelShape, par: Parallel, rank: int, bias: bool) -> ParamCount:
    """Parameters held by one GPU of pipeline rank `rank` (all its model chunks)."""
    out = ParamCount()
    embedding = s.vocab * s.hidden / par.tp
    kinds = [kind for chunk in par.chunks[rank] for kind, _ in chunk]
    if EMBEDDING in kinds or (MTP in kinds and EMBEDDING not in kinds):
        out += _plain(embedding)  # the MTP stage keeps its own copy of the word embeddings
    for kind in kinds:
        if kind in (DENSE, MOE):
            out += layer_params(s, par, kind, bias)
        elif kind == MTP:
            out += mtp_params(s, par, bias)
        elif kind == LOSS:
            out += _plain(s.hidden * s.norm_params)  # final layernorm
            if s.untied_embeddings or (EMBEDDING not in kinds and MTP not in kinds):
                out += _plain(embedding)  # output layer (a tied one on another stage is a copy too)
    return out
