"""Saved activations of one micro-batch, per layer, in bytes: an inventory of the tensors autograd
keeps between a layer's forward and its backward, read off Megatron-Core 0.19's modules.

Conventions: T tokens per micro-batch on this GPU, h hidden size, model dtype bf16 (2 bytes).
A tensor several consumers save is counted once; an FP8 GEMM keeps its own FP8 copy of its input
(Transformer Engine saves the quantized input for the weight gradient), so under FP8 a LayerNorm
output read by two GEMMs costs two FP8 copies, unless Megatron tells the GEMM to keep the original
BF16 tensor (`set_save_original_input`: the attention output projection, and the GEMMs after a
recomputed LayerNorm). Routed experts see k*T rows per GPU (balanced routing: each GPU receives
on average what it sends). Dropout is 0 in these configs, so no masks are kept.

Our FP8 linears (--moe-fp4-linears fp8: attention projections, MLA up-projections, dense MLP,
shared experts) keep only their own copy of their input: FP8 1x128 (1 byte + one fp32 scale per 128
elements), or MXFP4 (K/2 + K/32 bytes per row) under --moe-fp4-storage all, except the output
projection after fused attention, which keeps by reference the BF16 output that attention saves
(_output_projection_input). --moe-fp4-storage all also keeps the
dense-MLP and shared-expert SwiGLU inputs in MXFP4; a recomputed module (Megatron's recompute,
`storage_rc`) keeps FP8 / BF16 there, so what its recompute restores in backward is counted in those
formats. Under `layernorm` recompute, those reading a LayerNorm output (qkv or MLA's q / kv
down-projections, the dense MLP's and shared experts' fc1) keep that BF16 tensor by reference
instead, as Megatron has Transformer Engine's do (`set_save_original_input`): the recompute
discards it, so they save nothing (Ctx.keeps_layernorm_output). Each tensor asks whether its own
role is FP8 (Precision.fp8_linear): a role --moe-fp4-bf16-linears names is Megatron's linears,
saving what they save without our linears (BF16 inputs and SwiGLU input, also under
--moe-fp4-storage all).

Each function returns {component: bytes}; `recompute` drops what Megatron recomputes.
"""

from dataclasses import dataclass

from ..options import RECOMPUTED_BY, LinearRole
from . import wgrad_buffers
from .params import fp8_linear_copy_elements, fp8_linear_shapes
from .precision import FP8_1X128_BYTES, FP8_128X128_BYTES, MXFP4_BYTES, Precision
from .recompute import NONE, Recompute
from .shapes import DENSE, MOE, ModelShape, Parallel

ATTENTION = LinearRole.ATTENTION  # the projections outside mla_up_proj (only full recompute covers them)
MLA_UP = LinearRole.MLA_UP_PROJECTION
MLP = LinearRole.DENSE_MLP
SHARED = LinearRole.SHARED_EXPERTS


@dataclass(frozen=True)
class Ctx:
    s: ModelShape
    par: Parallel
    p: Precision
    rc: Recompute
    tokens: int  # per micro-batch on this GPU
    rope: bool
    softmax_fp32: bool
    ce_bytes: float  # bytes per vocab entry the cross entropy saves (fp32 softmax: 4)
    bias: bool
    storage_rc: Recompute | None = None  # the run's recompute, which decides MXFP4 storage (None: rc)

    @property
    def resid(self) -> float:
        """Tokens of a residual-stream tensor (split over TP under sequence parallelism)."""
        return self.tokens / (self.par.tp if self.par.sequence_parallel else 1)

    def with_recompute(self, rc: Recompute) -> "Ctx":
        """The same layer under another recompute, storing what the run's own recompute stores."""
        return Ctx(self.s, self.par, self.p, rc, self.tokens, self.rope, self.softmax_fp32, self.ce_bytes, self.bias,
                   self.run_recompute)

    @property
    def run_recompute(self) -> Recompute:
        """The run's own recompute, which decides how our layers store (`rc` may be another one)."""
        return self.storage_rc or self.rc

    def role_recomputed(self, role: LinearRole) -> bool:
        """Whether the run recomputes `role`'s module (options.RECOMPUTED_BY, the plugin's own rule;
        full recompute covers all)."""
        rc = self.run_recompute
        if role in (ATTENTION, MLA_UP) and "attn" in rc:  # the fork's whole-attention module
            return True
        return rc.granularity == "full" or any(module in rc for module in RECOMPUTED_BY[role])

    def fp4_stored(self, role: LinearRole) -> bool:
        """Whether `role`'s linear inputs and SwiGLU input are kept in MXFP4 (--moe-fp4-storage all,
        which only our FP8 linears do): not inside a recomputation."""
        return self.p.fp4_storage_all and self.p.fp8_linear(role) and not self.role_recomputed(role)

    def keeps_layernorm_output(self, role: LinearRole) -> bool:
        """Whether our FP8 linears of `role` that read a LayerNorm output keep that BF16 tensor by
        reference (SavedInput.ORIGINAL) rather than a copy: under the run's `layernorm` recompute,
        which discards it after forward and recomputes it for backward, unless the role's own
        module is recomputed (then the existing rule holds). Only the readers of a LayerNorm ask."""
        return self.p.fp8_linear(role) and "layernorm" in self.run_recompute and not self.role_recomputed(role)

    def own_input_copy(self, role: LinearRole) -> bool:
        """Whether the linears of `role` that read a LayerNorm output keep their own FP8 / MXFP4 copy."""
        return self.p.fp8_linear(role) and not self.keeps_layernorm_output(role)

    def linear_input(self, role: LinearRole) -> float:
        """Bytes per element our FP8 linear of `role` keeps of its input."""
        return MXFP4_BYTES if self.fp4_stored(role) else FP8_1X128_BYTES

    def swiglu_input(self, role: LinearRole) -> float:
        """Bytes per element of the dense-MLP / shared-expert SwiGLU input (the fc1 output)."""
        return MXFP4_BYTES if self.s.swiglu and self.fp4_stored(role) else self.p.model_bytes

    def fc2_input(self, role: LinearRole) -> float:
        """Bytes per element fc2 of the dense MLP / shared experts keeps of its input."""
        if self.p.fp8_linear(role):
            return self.linear_input(role)
        return self.p.gemm_input_bytes


def _core_attention(c: Ctx, heads: float, v_dim: int) -> dict:
    """The core attention's own saves besides its inputs (dropped by core_attn recompute)."""
    if "core_attn" in c.rc:
        return {}
    b, s = c.s.micro_batch, c.s.seq_length // c.par.cp
    if c.s.fused_attention:  # fused attention: output (bf16) and log-sum-exp (fp32)
        return {"attn_out_bf16": c.tokens * heads * v_dim * c.p.model_bytes, "attn_lse": c.tokens * heads * 4}
    probs = b * heads * s * s  # unfused: softmax probabilities [b, heads, s, s]
    per = c.p.model_bytes + (4 if c.softmax_fp32 else 0)  # fp32 softmax keeps its fp32 output too
    return {"attn_probs": probs * per, "attn_mask": s * s}


def _output_projection_input(c: Ctx, attention: dict, features: float) -> dict:
    """What the attention output projection saves of its input, if not a tensor already counted.

    Its input is the core attention's output, which fused attention saves in BF16 itself. Under
    FP8 with any scaling recipe but 'delayed', Megatron has the projection save that original BF16
    tensor rather than its own FP8 copy (`set_save_original_input`; Transformer Engine >= 2.6,
    which Megatron also requires for FP8 with `layernorm` recompute), so nothing is added then.
    Our FP8 linear keeps that tensor by reference too where the fused attention (ours: our linears
    run without Transformer Engine) saves it, that is unless core_attn recompute drops it
    (module.saved_by_its_producer); else its own FP8 / MXFP4 copy.
    """
    if c.p.fp8_linear(ATTENTION):
        # Decided in the run's first forward, which a recompute of other modules never re-runs.
        if c.s.fused_attention and "core_attn" not in c.run_recompute:
            return {}
        return {"proj_in": c.tokens * features * c.linear_input(ATTENTION)}
    saves_original = not c.p.fp8 or (c.s.te and c.p.fp8_recipe != "delayed")
    if saves_original and "attn_out_bf16" in attention:
        return {}
    bytes_per = c.p.model_bytes if saves_original else c.p.gemm_input_bytes
    return {"proj_in": c.tokens * features * bytes_per}


def _recomputed_attention(c: Ctx) -> dict:
    """The fork's `attn` recompute: the block's checkpoint keeps its input, the input LayerNorm's
    output (nothing under `layernorm`, which discards it and restores it for backward)."""
    out = {"layer_input": c.resid * c.s.hidden * c.p.model_bytes}
    if "layernorm" not in c.rc:
        out["attn_checkpoint_in"] = c.resid * c.s.hidden * c.p.model_bytes
    return out


def standard_attention(c: Ctx) -> dict:
    if "attn" in c.rc:
        return _recomputed_attention(c)
    s, tp, mb, T = c.s, c.par.tp, c.p.model_bytes, c.tokens
    heads, groups, d = s.heads / tp, s.query_groups / tp, s.head_dim
    out = {"layer_input": c.resid * s.hidden * mb}
    if c.own_input_copy(ATTENTION):
        out["qkv_in"] = c.resid * s.hidden * c.linear_input(ATTENTION)
    elif s.te and not c.p.fp8_linear(ATTENTION):  # input layernorm fused into the QKV GEMM: it keeps its LN output
        out["qkv_in"] = c.resid * s.hidden * c.p.gemm_input_bytes
    elif "layernorm" not in c.rc:  # the LN output (ours under layernorm recompute: restored for backward)
        out["qkv_in"] = c.resid * s.hidden * mb
    # q, k, v are views into the fused QKV output; RoPE makes new q and k. Local attention repeats
    # k and v to every head under grouped-query attention (new tensors), fused attention does not.
    repeat = not s.fused_attention and s.query_groups != s.heads
    if repeat:
        out["k_v_repeated"] = 2 * T * heads * d * mb
    if not repeat or not c.rope:  # a view (v, or q without RoPE) keeps the QKV output alive
        out["qkv_out"] = T * (heads + 2 * groups) * d * mb
    if c.rope:
        out["q_rope"] = T * heads * d * mb
        if not repeat:
            out["k_rope"] = T * groups * d * mb
    out.update(_core_attention(c, heads, d))
    out.update(_output_projection_input(c, out, heads * d))
    return out


def mla_attention(c: Ctx) -> dict:
    if "attn" in c.rc:
        return _recomputed_attention(c)
    s, tp, mb, T = c.s, c.par.tp, c.p.model_bytes, c.tokens
    heads = s.heads / tp
    q_head = s.qk_head_dim + s.qk_rope_dim
    out = {"layer_input": c.resid * s.hidden * mb}
    if c.own_input_copy(ATTENTION):  # the q and kv down-projections' own copies
        out["down_in"] = 2 * c.resid * s.hidden * c.linear_input(ATTENTION)
    elif "layernorm" not in c.rc:  # input layernorm output, read by the q and kv down-projections
        out["down_in"] = c.resid * s.hidden * (2 * c.p.fp8_act_bytes if c.p.fp8 else mb)
    compressed = T * ((s.q_lora_rank or 0) + s.kv_lora_rank + s.qk_rope_dim) * mb
    up = MLA_UP not in c.rc
    ours = c.p.fp8_linear(MLA_UP)
    own_copies = c.p.fp8 or ours  # the up-projections keep their own FP8 / MXFP4 inputs
    if s.qk_layernorm or not up or not own_copies:
        # the up-projections' input (or their LayerNorms' input, or the recompute's checkpoint input)
        out["q_kv_compressed"] = compressed
    if up:
        if s.qk_layernorm or own_copies:  # LayerNorm outputs, or the FP8 GEMMs' own copies of their inputs
            per = c.linear_input(MLA_UP) if ours else c.p.gemm_input_bytes
            out["up_in"] = T * ((s.q_lora_rank or 0) + s.kv_lora_rank) * per
        out["q"] = T * heads * q_head * mb
        out["k"] = T * heads * q_head * mb
        out["v"] = T * heads * s.v_head_dim * mb
    out.update(_core_attention(c, heads, s.v_head_dim))
    out.update(_output_projection_input(c, out, heads * s.v_head_dim))
    return out


def dense_mlp(c: Ctx) -> dict:
    s, tp, mb, T = c.s, c.par.tp, c.p.model_bytes, c.tokens
    ffn = s.ffn_hidden / tp
    out = {"mlp_input": c.resid * s.hidden * mb}
    recompute = MLP in c.rc
    ours = c.p.fp8_linear(MLP)
    if c.own_input_copy(MLP) and not recompute:
        out["fc1_in"] = c.resid * s.hidden * c.linear_input(MLP)
    elif s.te and not ours:  # pre-MLP layernorm fused into fc1: fc1 keeps the LN output
        if not recompute:
            out["fc1_in"] = c.resid * s.hidden * c.p.gemm_input_bytes
    elif "layernorm" not in c.rc:
        out["fc1_in"] = c.resid * s.hidden * mb  # also the mlp checkpoint's input
    if not recompute:
        out["fc1_out"] = T * s.fc1_factor * ffn * c.swiglu_input(MLP)
        out["fc2_in"] = T * ffn * c.fc2_input(MLP)
    return out


def dispatched_bytes(p: Precision) -> float:
    """Bytes per element of the tokens as the experts receive them: the MXFP4 payload where the
    experts keep it, FP8 1x128 under an FP8 dispatch (FP8-Flow-MoE's), else the model dtype."""
    if p.fp4_expert_input:
        return MXFP4_BYTES
    return FP8_1X128_BYTES if p.fp8_dispatch else p.model_bytes


def expert_rows(c: Ctx) -> float:
    """Rows the routed experts of one GPU process per micro-batch (balanced routing)."""
    return c.tokens * c.s.topk


def moe_mlp(c: Ctx) -> dict:
    s, tp, mb, p = c.s, c.par.tp, c.p.model_bytes, c.p
    h = s.hidden
    out = {"mlp_input": c.resid * h * mb}
    rows = expert_rows(c)
    ln_dropped = "layernorm" in c.rc
    if "moe" in c.rc:
        if not ln_dropped:
            out["moe_checkpoint_in"] = c.resid * h * mb
        if p.fp4_cache:  # received MXFP4 payload kept for the recompute (no second dispatch; probs re-sent)
            out["fp4_cache"] = rows * h * MXFP4_BYTES
        return out
    if not ln_dropped:
        out["router_in"] = c.resid * h * mb  # the router (and a BF16 shared expert) keep the LN output
    out["router"] = c.tokens * s.experts * 9  # fp32 scores for routing and for the aux loss, bool map
    out["routing_indices"] = rows * 8
    if s.shared_ffn_hidden and SHARED not in c.rc:
        fs = s.shared_ffn_hidden / tp
        if c.own_input_copy(SHARED):  # else it reads the LN output router_in keeps (or layernorm recomputes)
            out["shared_fc1_in"] = c.resid * h * c.linear_input(SHARED)
        elif p.fp8 and not ln_dropped:  # Transformer Engine's FP8 copy
            out["shared_fc1_in"] = c.resid * h * p.fp8_act_bytes
        out["shared_fc1_out"] = c.tokens * s.fc1_factor * fs * c.swiglu_input(SHARED)
        out["shared_fc2_in"] = c.tokens * fs * c.fc2_input(SHARED)
    if "moe_expert" in c.rc:  # the experts' checkpoint keeps its inputs: the tokens as dispatched, the probs
        out["expert_checkpoint_in"] = rows * h * dispatched_bytes(p)
        out["expert_probs"] = rows * 4
        return out
    fm = s.moe_ffn_hidden / c.par.etp
    # Our FP8 experts keep their SwiGLU and fc2 inputs in MXFP4, except inside a recomputation (the
    # whole MoE layer's, the experts' or full): there a BF16 SwiGLU input and FP8 columns of the fc2 input.
    storage_rc = c.run_recompute
    fp4 = p.fp4_experts and not (storage_rc.granularity == "full" or "moe" in storage_rc or "moe_expert" in storage_rc)
    # Our FP8 experts without a payload (the FP8 baseline) keep the fc1 and fc2 inputs as FP8 1x128
    # columns (each expert's tokens padded to 128, left out here) and the SwiGLU input in BF16.
    gemm_input = FP8_1X128_BYTES if p.fp8_experts else p.gemm_input_bytes
    out["expert_fc1_in"] = rows * h * (MXFP4_BYTES if p.fp4_expert_input else gemm_input)
    out["expert_fc1_out"] = rows * s.fc1_factor * fm * (MXFP4_BYTES if fp4 else mb)
    if "moe_act" not in c.rc:
        out["expert_fc2_in"] = rows * fm * (MXFP4_BYTES if fp4 else gemm_input)
    out["expert_probs"] = rows * 4
    return out


def _parts(c: Ctx, kind: str) -> tuple[dict, dict]:
    """One layer's (attention, MLP) saved tensors under selective or no recompute."""
    attention = mla_attention(c) if c.s.mla else standard_attention(c)
    return attention, dense_mlp(c) if kind == DENSE else moe_mlp(c)


def layer(c: Ctx, kind: str) -> dict:
    """One decoder layer (or an MTP layer's transformer layer)."""
    if c.rc.granularity == "full":
        return {"layer_input": c.resid * c.s.hidden * c.p.model_bytes / c.rc.num_layers}
    out, mlp = _parts(c, kind)
    for key, value in mlp.items():
        out[key] = out.get(key, 0) + value
    return out


def mtp_extras(c: Ctx) -> dict:
    """An MTP layer around its transformer layer: normed embedding / hidden inputs, their
    concatenation (eh_proj's input) and the MTP final layernorm's input."""
    h, mb = c.s.hidden, c.p.model_bytes
    return {"mtp_norm_inputs": 2 * c.resid * h * mb,
            "eh_proj_in": c.resid * 2 * h * (c.p.gemm_input_bytes if c.p.fp8 and c.s.te else mb),
            "mtp_final_norm_in": c.resid * h * mb}


def head(c: Ctx, heads: int) -> dict:
    """Final layernorm, output layer(s) and cross entropy: `heads` = 1 + MTP layers."""
    h, mb, T = c.s.hidden, c.p.model_bytes, c.tokens
    vocab = c.s.vocab / c.par.tp
    return {"final_norm_in": c.resid * h * mb,
            "output_layer_in": heads * c.resid * h * mb,
            "cross_entropy": heads * T * vocab * c.ce_bytes}


def logits_transient(c: Ctx) -> float:
    """The logits in the model dtype, alive while the cross entropy makes its fp32 copy."""
    return c.tokens * c.s.vocab / c.par.tp * c.p.model_bytes


def mtp_hidden_gradient(c: Ctx) -> float:
    """While the MTP layers run backward: the gradient of the main and MTP hidden states, which the
    model concatenates for the output layer (one [(1 + MTP layers) T, h] tensor, SplitBackward0's);
    its main part waits there for the MTP layers' share of the decoder output's gradient."""
    return (1 + c.s.mtp_layers) * c.resid * c.s.hidden * c.p.model_bytes


def _restored(c: Ctx, kind: str) -> tuple[float, float]:
    """Bytes a layer's recompute brings back for its (attention, MLP) backward. Full recompute
    restores the whole layer (less its input, which stays saved) before the MLP backward; the
    attention backward runs after the MLP's restored tensors are gone."""
    full_attention, full_mlp = (sum(p.values()) for p in _parts(c.with_recompute(NONE), kind))
    if c.rc.granularity == "full":
        whole = full_attention + full_mlp - sum(layer(c, kind).values())
        return whole - full_mlp, whole
    attention, mlp = (sum(p.values()) for p in _parts(c, kind))
    return full_attention - attention, full_mlp - mlp


def transposed_weight(c: Ctx, kind: str) -> tuple[float, float]:
    """The FP8 W^T our linears and experts quantize for a data-gradient GEMM and free after it, while
    (attention, MLP) backward runs, with or without the per-step W cache. One linear's at a time, the
    largest of the phase's FP8 roles (none: 0), and in an MoE layer's MLP all local experts' fc1
    weights at once (one stacked operand). None under keep_transposed_weights: W^T is held for the
    step (static.py)."""
    if c.p.keep_transposed_weights:
        return 0.0, 0.0
    def largest_linear(roles: set) -> float:
        shapes = fp8_linear_shapes(c.s, kind, c.p.fp8_linear_roles & roles)
        return max(map(fp8_linear_copy_elements, shapes), default=0) * FP8_128X128_BYTES

    experts = 0.0
    if kind == MOE and c.p.fp8_experts:
        local_experts = c.s.experts / c.par.local_experts_divisor
        experts = local_experts * c.s.fc1_factor * c.s.moe_ffn_hidden * c.s.hidden * FP8_128X128_BYTES
    return largest_linear({ATTENTION, MLA_UP}), max(largest_linear({MLP, SHARED}), experts)


def _attention_heads(c: Ctx) -> tuple[float, int]:
    """(heads on this GPU, value head dim) of the core attention."""
    return c.s.heads / c.par.tp, c.s.v_head_dim if c.s.mla else c.s.head_dim


def _unfused_attention_backward(c: Ctx) -> float:
    """Besides what the recompute restores (the probabilities, the mask), Megatron's unfused
    attention backward holds three more [b, heads, s, s] tensors in the model dtype (traced at the
    masked-fill backward: AsStridedBackward0's new_zeros, CopySlices' new_empty_strided and clone,
    MaskedFillBackward0's clone; the scores live in the kept global buffer, softmax's output is
    freed by then) and these gradients in flight: the layer output's (residual stream), the core
    attention output's (the output projection's dgrad), the value's, and under core_attn recompute
    the recomputed core attention output, held until the checkpoint's backward returns."""
    b, s = c.s.micro_batch, c.s.seq_length // c.par.cp
    heads, v_dim = _attention_heads(c)
    scores = 3 * b * heads * s * s * c.p.model_bytes
    per_head_tensors = 3 if "core_attn" in c.rc else 2
    gradients = c.resid * c.s.hidden * c.p.model_bytes + per_head_tensors * c.tokens * heads * v_dim * c.p.model_bytes
    return scores + gradients


def backward_working_set(c: Ctx, kind: str) -> float:
    """Extra memory while one layer runs its backward, on top of every saved activation: the larger
    of its two phases. The MLP backward (first): what its recompute restores plus two of its largest
    MLP tensors (a gradient being produced while the gradient it is computed from is alive; for an
    MoE layer the combine / dispatch all-to-all's send and receive buffers in the model dtype are at
    least as large). The attention backward (after it, the MLP's saved tensors freed): what its
    recompute restores plus, for unfused attention, its score-sized buffers and gradients in flight
    (_unfused_attention_backward), for fused attention two of its largest tensors. Each phase also
    holds the FP8 W^T of its largest data-gradient GEMM of ours (transposed_weight); an MoE layer's MLP
    phase on Transformer Engine's grouped experts also fc1's dummy weight gradients (wgrad_buffers.py)."""
    full_attention, full_mlp = _parts(c.with_recompute(NONE), kind)
    restored_attention, restored_mlp = _restored(c, kind)
    transposed_attention, transposed_mlp = transposed_weight(c, kind)
    largest_mlp = max(full_mlp.values())
    if kind == MOE:
        largest_mlp = max(largest_mlp, expert_rows(c) * c.s.hidden * c.p.model_bytes)
    mlp_phase = restored_mlp + 2 * largest_mlp + transposed_mlp
    if kind == MOE:  # Transformer Engine's grouped experts: fc1's per-expert dummy weight gradients
        mlp_phase += wgrad_buffers.grouped_dummy_wgrads_bytes(c.s, c.par, c.p)
    if c.s.fused_attention:
        attention_buffers = 2 * max(full_attention.values())
    else:
        attention_buffers = _unfused_attention_backward(c)
    mlp_freed = 0.0 if c.rc.granularity == "full" else sum(_parts(c, kind)[1].values())
    attention_phase = restored_attention + attention_buffers + transposed_attention - mlp_freed
    return max(mlp_phase, attention_phase)
