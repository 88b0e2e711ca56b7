"""Parameter counts from the shapes, per pipeline rank, split the ways the memory depends on:
dense parameters (replicated over TP-complement data parallelism, optimizer sharded over DP) vs
routed-expert parameters (optimizer sharded over expert data parallelism), and which weights feed
FP8 GEMMs (Transformer Engine keeps FP8 copies of those).

Counts follow the modules Megatron-Core builds (megatron/core/transformer/*): biases only with
add_bias_linear, RMSNorm has a weight, LayerNorm a weight and a bias.

Our FP8 linears (--moe-fp4-linears fp8, TP 1) keep an FP8 copy of their weights padded to multiples
of 128 in both dimensions (MLA's kv down-projection: 576 output features -> 640):
`fp8_linear_padded` counts those padded elements, of the FP8 roles only (a role
--moe-fp4-bf16-linears names is Megatron's BF16 linears, which hold no FP8 copy).
"""

from dataclasses import dataclass

from ..formats import FP8_BLOCK
from ..options import LinearRole
from .shapes import DENSE, EMBEDDING, LOSS, MOE, MTP, ModelShape, Parallel


@dataclass
class ParamCount:
    dense: float = 0.0  # parameters whose optimizer state is sharded over DP
    expert: float = 0.0  # routed-expert parameters: optimizer state sharded over expert-DP
    dense_gemm: float = 0.0  # of `dense`: weights of Transformer Engine GEMMs (FP8 copies under FP8)
    expert_gemm: float = 0.0
    fp8_linear: float = 0.0  # of `dense_gemm`: weights of the linears of the FP8 roles (ours)
    fp8_linear_padded: float = 0.0  # the same, padded to 128 x 128 blocks (their FP8 copy's elements)

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


def linear_shapes_by_role(s: ModelShape, kind: str) -> dict[LinearRole, list[tuple[int, int]]]:
    """(output features, input features) of each linear of one decoder layer our FP8 linears can
    replace (TP 1), by role (megatron_fp4/integration/linears_spec.py): the attention projections,
    MLA's up-projections, the dense MLP's fc1 / fc2 or the shared experts'."""
    h = s.hidden
    out = {}
    if s.mla:
        q_head = s.qk_head_dim + s.qk_rope_dim
        q_down = [(s.q_lora_rank, h)] if s.q_lora_rank else [(s.heads * q_head, h)]  # or the one q projection
        out[LinearRole.ATTENTION] = q_down + [(s.kv_lora_rank + s.qk_rope_dim, h), (h, s.heads * s.v_head_dim)]
        q_up = [(s.heads * q_head, s.q_lora_rank)] if s.q_lora_rank else []
        out[LinearRole.MLA_UP_PROJECTION] = q_up + [(s.heads * (s.qk_head_dim + s.v_head_dim), s.kv_lora_rank)]
    else:
        out[LinearRole.ATTENTION] = [((s.heads + 2 * s.query_groups) * s.head_dim, h), (h, s.heads * s.head_dim)]
    ffn, role = (s.ffn_hidden, LinearRole.DENSE_MLP) if kind == DENSE else (s.shared_ffn_hidden, LinearRole.SHARED_EXPERTS)
    if ffn:
        out[role] = [(s.fc1_factor * ffn, h), (h, ffn)]
    return out


def fp8_linear_shapes(s: ModelShape, kind: str, roles: frozenset) -> list[tuple[int, int]]:
    """The shapes of linear_shapes_by_role of the FP8 `roles` only."""
    return [shape for role, shapes in linear_shapes_by_role(s, kind).items() if role in roles for shape in shapes]


def fp8_linear_copy_elements(shape: tuple[int, int]) -> int:
    """Elements of one FP8 copy (W or W^T) of a linear's weight, both dimensions padded to 128."""
    return _padded(shape[0]) * _padded(shape[1])


def _fp8_linears(s: ModelShape, kind: str, roles: frozenset) -> ParamCount:
    shapes = fp8_linear_shapes(s, kind, roles)
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


def layer_params(s: ModelShape, par: Parallel, kind: str, bias: bool, fp8_roles: frozenset) -> ParamCount:
    h = s.hidden
    out = attention_params(s, par.tp, bias)
    out += _plain(2 * h * s.norm_params)  # input and pre-MLP layer norms
    out += _fp8_linears(s, kind, fp8_roles)
    if kind == DENSE:
        out += mlp_params(h, s.ffn_hidden, s.fc1_factor, par.tp, bias)
        return out
    out += _plain(s.experts * h)  # router
    if s.shared_ffn_hidden:
        out += mlp_params(h, s.shared_ffn_hidden, s.fc1_factor, par.tp, bias)
    routed = s.experts * (h * s.fc1_factor * s.moe_ffn_hidden + s.moe_ffn_hidden * h) / par.local_experts_divisor
    out += ParamCount(expert=routed, expert_gemm=routed)
    return out


def mtp_params(s: ModelShape, par: Parallel, bias: bool, fp8_roles: frozenset) -> ParamCount:
    out = _plain(3 * s.hidden * s.norm_params)  # enorm, hnorm, final layernorm
    out += _gemm(2 * s.hidden * s.hidden / par.tp)  # eh_proj
    out += layer_params(s, par, MOE if s.mtp_is_moe else DENSE, bias, fp8_roles)
    return out


def rank_params(s: ModelShape, par: Parallel, rank: int, bias: bool, fp8_roles: frozenset = frozenset()) -> ParamCount:
    """Parameters held by one GPU of pipeline rank `rank` (all its model chunks); `fp8_roles`: the
    linear roles whose weights our FP8 linears hold (ParamCount.fp8_linear)."""
    out = ParamCount()
    embedding = s.vocab * s.hidden / par.tp
    kinds = [kind for chunk in par.chunks[rank] for kind, _ in chunk]
    if EMBEDDING in kinds or (MTP in kinds and EMBEDDING not in kinds):
        out += _plain(embedding)  # the MTP stage keeps its own copy of the word embeddings
    for kind in kinds:
        if kind in (DENSE, MOE):
            out += layer_params(s, par, kind, bias, fp8_roles)
        elif kind == MTP:
            out += mtp_params(s, par, bias, fp8_roles)
        elif kind == LOSS:
            out += _plain(s.hidden * s.norm_params)  # final layernorm
            if s.untied_embeddings or (EMBEDDING not in kinds and MTP not in kinds):
                out += _plain(embedding)  # output layer (a tied one on another stage is a copy too)
    return out
