"""The estimator's model of --moe-fp4-linears fp8 and --moe-fp4-storage all (docs/design.md §6.3, §7):
what our FP8 linears, the dense-MLP / shared-expert SwiGLUs and the FP8 experts keep for backward,
their FP8 weight copies, the roles --moe-fp4-bf16-linears leaves to Megatron, and the 671B configs'
fits / OOM pattern. Expected bytes are written out from the shapes, not copied from the estimator."""

import dataclasses
from pathlib import Path

import pytest

from megatron_fp4.estimator import estimate
from megatron_fp4.estimator.activations import Ctx, backward_working_set, dense_mlp, moe_mlp
from megatron_fp4.estimator.params import fp8_linear_copy_elements, fp8_linear_shapes
from megatron_fp4.estimator.recompute import NONE
from megatron_fp4.estimator.shapes import DENSE, MOE, MTP
from megatron_fp4.options import LinearRole

ROOT = Path(__file__).resolve().parents[2]
DSV3 = ROOT / "configs" / "deepseek_v3_671b"
MEMCAP = ROOT / "configs" / "proxy" / "memcap_bf16_attn.yaml"
SCOPES = ("attn_ln_moe", "attn_ln_mlp", "mla_up_proj")

# memcap_base.yaml on one GPU of its two (PP 1): standard attention (16 heads of 64, no GQA), RoPE,
# 8 x 1024 tokens per micro-batch, 1 dense layer (FFN 2816) + 5 MoE layers + 1 MoE MTP layer, shared
# expert 512, 16 experts of 2048 top-8 over EP 2, SwiGLU, no biases.
T, H, FFN, SHARED, MOE_FFN, TOPK, LOCAL_EXPERTS, MOE_LAYERS = 8 * 1024, 1024, 2816, 512, 2048, 8, 8, 5
ROWS = T * TOPK
FP8_LINEARS = {"moe_fp4_linears": "fp8", "moe_fp4_experts": "fp8"}  # the FP8 baseline
FP4_ALL = {**FP8_LINEARS, "moe_fp4_dispatch": True, "moe_fp4_storage": "all"}  # the paper's recipe
FP8_WEIGHT = 1 + 4 / (128 * 128)  # bytes per element of a 128x128-block FP8 copy
LAYERS = {"dense": 1, "moe": MOE_LAYERS, "mtp": 1}  # components' prefixes: layers of each on the GPU
# memcap_base.yaml made MLA (as DeepSeek-V3, smaller): q / kv LoRA ranks, q heads of 64 + 32 (RoPE).
MLA = {"multi_latent_attention": True, "q_lora_rank": 256, "kv_lora_rank": 128, "qk_head_dim": 64,
       "qk_pos_emb_head_dim": 32, "v_head_dim": 64, "qk_layernorm": True}
Q_LORA, KV_LORA = 256, 128


def fp8_row(k):
    """A K-wide row in FP8 1x128 blocks: 1 byte per element + one fp32 scale per 128."""
    return k + 4 * k / 128


def mxfp4_row(k):
    """A K-wide row in MXFP4: K/2 bytes of E2M1 pairs + one E8M0 byte per 32."""
    return k / 2 + k / 32


def components(overrides, mode="installed"):
    return estimate(MEMCAP, mode, overrides).peak_rank.components


def test_fp8_linears_keep_fp8_inputs_and_bf16_swiglu_inputs():
    c = components(FP8_LINEARS)
    assert c["dense.qkv_in"] == T * fp8_row(H)
    assert c["dense.proj_in"] == T * fp8_row(16 * 64)
    assert c["dense.fc1_in"] == T * fp8_row(H)
    assert c["dense.fc1_out"] == T * 2 * FFN * 2  # SwiGLU input: BF16
    assert c["dense.fc2_in"] == T * fp8_row(FFN)
    assert c["moe.qkv_in"] == MOE_LAYERS * T * fp8_row(H)
    assert c["moe.shared_fc1_in"] == MOE_LAYERS * T * fp8_row(H)
    assert c["moe.shared_fc1_out"] == MOE_LAYERS * T * 2 * SHARED * 2
    assert c["moe.shared_fc2_in"] == MOE_LAYERS * T * fp8_row(SHARED)
    # Our FP8 experts without the FP4 dispatch keep FP8 columns of the fc1 and fc2 inputs (the
    # segments' padding to 128 tokens left out) and the SwiGLU input in BF16.
    assert c["moe.expert_fc1_in"] == MOE_LAYERS * ROWS * fp8_row(H)
    assert c["moe.expert_fc1_out"] == MOE_LAYERS * ROWS * 2 * MOE_FFN * 2
    assert c["moe.expert_fc2_in"] == MOE_LAYERS * ROWS * fp8_row(MOE_FFN)
    assert c["mtp.shared_fc2_in"] == T * fp8_row(SHARED)  # the MTP layer's own MoE layer


def test_storage_all_keeps_every_linear_and_swiglu_input_in_mxfp4():
    c = components(FP4_ALL)
    assert c["dense.qkv_in"] == c["dense.fc1_in"] == T * mxfp4_row(H)
    assert c["dense.proj_in"] == T * mxfp4_row(16 * 64)
    assert c["dense.fc1_out"] == T * mxfp4_row(2 * FFN)
    assert c["dense.fc2_in"] == T * mxfp4_row(FFN)
    assert c["moe.shared_fc1_in"] == MOE_LAYERS * T * mxfp4_row(H)
    assert c["moe.shared_fc1_out"] == MOE_LAYERS * T * mxfp4_row(2 * SHARED)
    assert c["moe.shared_fc2_in"] == MOE_LAYERS * T * mxfp4_row(SHARED)
    assert c["moe.expert_fc1_in"] == MOE_LAYERS * ROWS * mxfp4_row(H)  # the received payload
    assert c["moe.expert_fc1_out"] == MOE_LAYERS * ROWS * mxfp4_row(2 * MOE_FFN)
    assert c["moe.expert_fc2_in"] == MOE_LAYERS * ROWS * mxfp4_row(MOE_FFN)
    # The recipe row is the same whatever the config's own flags.
    assert components(FP4_ALL, "recipe") == c == components({"moe_fp4_dispatch": True}, "recipe")


def test_storage_none_keeps_the_payload_and_the_fp8_baselines_expert_activations():
    """--moe-fp4-storage none: the received payload stays (exact), the experts' SwiGLU input is BF16
    and their fc2 input FP8 1x128, the linears' inputs FP8, as in the FP8 baseline; its memory cost
    over --moe-fp4-storage experts is those two expert activations."""
    none = components({**FP8_LINEARS, "moe_fp4_dispatch": True, "moe_fp4_storage": "none"})
    experts = components({**FP8_LINEARS, "moe_fp4_dispatch": True, "moe_fp4_storage": "experts"})
    assert none["moe.expert_fc1_in"] == MOE_LAYERS * ROWS * mxfp4_row(H)
    assert none["moe.expert_fc1_out"] == MOE_LAYERS * ROWS * 2 * MOE_FFN * 2
    assert none["moe.expert_fc2_in"] == MOE_LAYERS * ROWS * fp8_row(MOE_FFN)
    assert experts["moe.expert_fc1_out"] == MOE_LAYERS * ROWS * mxfp4_row(2 * MOE_FFN)
    assert none["dense.qkv_in"] == experts["dense.qkv_in"] == T * fp8_row(H)
    extra = {k: none[k] - experts[k] for k in none if none[k] != experts.get(k)}
    assert set(extra) == {f"{layer}.expert_{name}" for layer in ("moe", "mtp") for name in ("fc1_out", "fc2_in")}
    assert extra["moe.expert_fc2_in"] == MOE_LAYERS * ROWS * (fp8_row(MOE_FFN) - mxfp4_row(MOE_FFN))


def test_nothing_in_fp4_inside_a_recomputation():
    """Recomputed modules save only the checkpoint's input in the first pass; in backward their
    recompute restores FP8 linear inputs and BF16 SwiGLU inputs, not MXFP4."""
    e = estimate(MEMCAP, "installed", {**FP4_ALL, "recompute_modules": ["core_attn", "mlp", "shared_experts"]})
    c = e.peak_rank.components
    assert c["dense.fc1_in"] == T * H * 2  # the mlp checkpoint's BF16 input
    assert not any(k in c for k in ("dense.fc1_out", "dense.fc2_in", "moe.shared_fc1_in", "moe.shared_fc1_out"))
    assert c["dense.qkv_in"] == T * mxfp4_row(H)  # attention is not recomputed: still MXFP4
    ctx = Ctx(s=e.shape, par=e.parallel, p=e.precision, rc=e.recompute, tokens=T, rope=True, softmax_fp32=False,
              ce_bytes=4, bias=False)
    restored = ctx.with_recompute(NONE)  # what backward holds once the recompute has run
    assert dense_mlp(restored)["fc1_in"] == T * fp8_row(H)
    assert dense_mlp(restored)["fc1_out"] == T * 2 * FFN * 2
    assert dense_mlp(restored)["fc2_in"] == T * fp8_row(FFN)
    shared = moe_mlp(restored)
    assert (shared["shared_fc1_in"], shared["shared_fc1_out"]) == (T * fp8_row(H), T * 2 * SHARED * 2)
    # `moe` recompute covers the shared experts too.
    moe = Ctx(s=e.shape, par=e.parallel, p=e.precision, rc=estimate(
        MEMCAP, "installed", {**FP4_ALL, "recompute_modules": ["moe"]}).recompute, tokens=T, rope=True,
        softmax_fp32=False, ce_bytes=4, bias=False)
    restored_moe = moe_mlp(moe.with_recompute(NONE))
    assert restored_moe["shared_fc2_in"] == T * fp8_row(SHARED)
    # The routed experts' recompute keeps the payload (exact), but the SwiGLU input in BF16 and the
    # fc2 input as FP8 columns, not MXFP4.
    assert restored_moe["expert_fc1_in"] == ROWS * mxfp4_row(H)
    assert restored_moe["expert_fc1_out"] == ROWS * 2 * MOE_FFN * 2
    assert restored_moe["expert_fc2_in"] == ROWS * fp8_row(MOE_FFN)
    outside = moe_mlp(Ctx(s=e.shape, par=e.parallel, p=e.precision, rc=NONE, tokens=T, rope=True, softmax_fp32=False,
                          ce_bytes=4, bias=False))
    assert outside["expert_fc1_out"] == ROWS * mxfp4_row(2 * MOE_FFN)
    assert outside["expert_fc2_in"] == ROWS * mxfp4_row(MOE_FFN)


def test_fp8_weight_copies_of_linears_and_experts():
    """One FP8 copy (W; 128x128 blocks) of every weight our linears and experts hold, from a step's
    first forward to the next (W^T is made in backward); none with --moe-fp4-weights-per-use. MTP's
    eh_proj stays BF16."""
    bf16 = estimate(MEMCAP).peak_rank.static.weights
    fp8 = estimate(MEMCAP, "installed", FP8_LINEARS).peak_rank.static.weights
    attention = 3 * H * H + H * H  # qkv, proj
    linears = 7 * attention + 3 * FFN * H + 6 * 3 * SHARED * H  # 6 layers + MTP's; dense fc1 (x2) + fc2; shared
    experts = 6 * LOCAL_EXPERTS * 3 * MOE_FFN * H
    assert fp8 - bf16 == pytest.approx((linears + experts) * FP8_WEIGHT, rel=1e-12)
    per_use = estimate(MEMCAP, "installed", {**FP8_LINEARS, "moe_fp4_weights_per_use": True})
    assert per_use.peak_rank.static.weights == bf16
    # --moe-fp4-keep-transposed-weights: W^T of each, the same padded bytes again.
    kept = estimate(MEMCAP, "installed", {**FP8_LINEARS, "moe_fp4_keep_transposed_weights": True})
    assert kept.peak_rank.static.weights - bf16 == pytest.approx(2 * (linears + experts) * FP8_WEIGHT, rel=1e-12)
    both = estimate(MEMCAP, "installed", {**FP8_LINEARS, "moe_fp4_weights_per_use": True,
                                          "moe_fp4_keep_transposed_weights": True})
    assert not both.precision.keep_transposed_weights  # the plugin refuses the pair; no copy to keep


def test_kv_down_projection_weight_is_padded_to_128():
    s = estimate(DSV3 / "fp4_mla_up_proj.yaml").shape
    shapes = fp8_linear_shapes(s, MOE, frozenset(LinearRole))
    assert (512 + 64, 7168) in shapes  # kv_lora_rank + qk_pos_emb_head_dim outputs
    assert fp8_linear_copy_elements((576, 7168)) == 640 * 7168
    assert fp8_linear_copy_elements((1536, 7168)) == 1536 * 7168


@pytest.fixture(scope="module")
def dsv3():
    out = {}
    for p in ("bf16", "fp8", "fp4"):
        for scope in SCOPES:
            for mode in ("recipe", "installed"):
                for fused in (False, True):  # the configs set it; False: Megatron's unfused attention
                    overrides = {} if fused else {"moe_fp4_fused_attention": False}
                    out[(p, scope, mode, fused)] = estimate(DSV3 / f"{p}_{scope}.yaml", mode, overrides)
    return out


def test_paper_fp4_configs_installed_is_the_recipe(dsv3):
    for scope in SCOPES:
        for fused in (False, True):
            recipe, installed = dsv3[("fp4", scope, "recipe", fused)], dsv3[("fp4", scope, "installed", fused)]
            assert installed.precision == recipe.precision
            assert installed.peak_rank.components == recipe.peak_rank.components
            assert installed.peak_gib == recipe.peak_gib and installed.a2a == recipe.a2a


def test_671b_without_the_fused_attention_the_local_attention_does_not_fit(dsv3):
    """Our FP8 linears need Megatron's local layers, whose own core attention (DotProductAttention)
    keeps the [b, heads, s, s] probabilities: 4 GiB per layer and micro-batch at 128 heads x 4096."""
    for scope in SCOPES:
        for p in ("fp8", "fp4"):
            e = dsv3[(p, scope, "installed", False)]
            assert not e.shape.fused_attention and not e.fits
            layers = e.peak_rank.components["moe.attn_probs"] / (128 * 4096 * 4096 * 2)
            assert layers == round(layers) >= 1
    assert dsv3[("bf16", "attn_ln_moe", "recipe", False)].fits  # stock Megatron with Transformer Engine


def test_671b_pattern_with_the_fused_attention(dsv3):
    """As configured (--moe-fp4-fused-attention under our linears): all fit at the first scope, only
    FP4 at the other two, as in the paper (docs/estimator.md)."""
    fits = {(p, scope): dsv3[(p, scope, "installed", True)].fits for p in ("bf16", "fp8", "fp4") for scope in SCOPES}
    assert fits == {("bf16", "attn_ln_moe"): True, ("bf16", "attn_ln_mlp"): False, ("bf16", "mla_up_proj"): False,
                    ("fp8", "attn_ln_moe"): True, ("fp8", "attn_ln_mlp"): False, ("fp8", "mla_up_proj"): False,
                    ("fp4", "attn_ln_moe"): True, ("fp4", "attn_ln_mlp"): True, ("fp4", "mla_up_proj"): True}
    for p in ("fp8", "fp4"):
        e = dsv3[(p, "attn_ln_moe", "installed", True)]
        assert e.shape.fused_attention and not e.shape.te and "moe.attn_probs" not in e.peak_rank.components


def bf16_role_moves(roles, base=FP4_ALL):
    """What keeping `roles` in Megatron's BF16 linears changes on the GPU (PP 1: one rank): {component:
    bytes after - before} of one micro-batch's saved activations, the static weights' change, and
    the held activations' change."""
    before = estimate(MEMCAP, "installed", base).peak_rank
    after = estimate(MEMCAP, "installed", {**base, "moe_fp4_bf16_linears": list(roles)}).peak_rank
    a, b = before.components, after.components
    moved = {k: b.get(k, 0) - a.get(k, 0) for k in a.keys() | b.keys() if b.get(k, 0) != a.get(k, 0)}
    assert after.held == before.held == [1]
    assert after.activations - before.activations == pytest.approx(sum(moved.values()), rel=1e-12)
    return moved, after.static.weights - before.static.weights


def test_bf16_attention_saves_bf16_inputs_and_holds_no_fp8_copies():
    """Under storage all, qkv's and the output projection's saved inputs go from MXFP4 to BF16 (no
    TE, unfused attention: Megatron's projection keeps its BF16 input); 7 layers' qkv / proj FP8
    copies are gone."""
    moved, weights = bf16_role_moves(["attention"])
    per_layer = {"qkv_in": T * (2 * H - mxfp4_row(H)), "proj_in": T * (2 * 16 * 64 - mxfp4_row(16 * 64))}
    assert moved == {f"{p}.{k}": n * v for p, n in LAYERS.items() for k, v in per_layer.items()}
    assert weights == pytest.approx(-7 * (3 * H * H + H * H) * FP8_WEIGHT, rel=1e-12)


def test_bf16_dense_mlp_saves_bf16_inputs_and_swiglu_input():
    moved, weights = bf16_role_moves(["mlp"])
    assert moved == {"dense.fc1_in": T * (2 * H - mxfp4_row(H)),
                     "dense.fc1_out": T * (2 * 2 * FFN - mxfp4_row(2 * FFN)),  # Megatron's BF16 SwiGLU input
                     "dense.fc2_in": T * (2 * FFN - mxfp4_row(FFN))}
    assert weights == pytest.approx(-3 * FFN * H * FP8_WEIGHT, rel=1e-12)


def test_bf16_shared_experts_save_what_megatron_saves():
    """Megatron's shared expert reads the pre-MLP LayerNorm output the router keeps (router_in):
    no fc1 input of its own."""
    moved, weights = bf16_role_moves(["shared_experts"])
    per_layer = {"shared_fc1_in": -T * mxfp4_row(H), "shared_fc1_out": T * (2 * 2 * SHARED - mxfp4_row(2 * SHARED)),
                 "shared_fc2_in": T * (2 * SHARED - mxfp4_row(SHARED))}
    assert moved == {f"{p}.{k}": n * v for p, n in LAYERS.items() if p != "dense" for k, v in per_layer.items()}
    assert weights == pytest.approx(-6 * 3 * SHARED * H * FP8_WEIGHT, rel=1e-12)


def test_bf16_mla_up_projections_save_bf16_inputs():
    """The q / kv up-projections' inputs (the q / kv LayerNorm outputs) go from MXFP4 to BF16; their
    FP8 copies (16 heads x 96 from 256, 16 heads x (64 + 64) from 128) are gone."""
    moved, weights = bf16_role_moves(["mla_up_proj"], {**FP4_ALL, **MLA})
    up_in = T * (2 * (Q_LORA + KV_LORA) - mxfp4_row(Q_LORA + KV_LORA))
    assert moved == {f"{p}.up_in": n * up_in for p, n in LAYERS.items()}
    assert weights == pytest.approx(-7 * (16 * 96 * Q_LORA + 16 * 128 * KV_LORA) * FP8_WEIGHT, rel=1e-12)


def test_a_bf16_role_under_layernorm_recompute_keeps_no_copy_of_its_own():
    """As Megatron's linears without ours: qkv reads the recomputed LayerNorm output, and so does our
    fc1 next to it (by reference); Megatron's output projection keeps its BF16 input, our fc2 MXFP4."""
    c = components({**FP4_ALL, "recompute_modules": ["core_attn", "layernorm"], "moe_fp4_bf16_linears": ["attention"]})
    assert "dense.qkv_in" not in c and c["dense.proj_in"] == T * 16 * 64 * 2
    assert "dense.fc1_in" not in c and c["dense.fc2_in"] == T * mxfp4_row(FFN)


def layernorm_recompute_moves(base, modules=("core_attn",)):
    """{component: bytes with - without `layernorm` added to `modules`} of one micro-batch on the GPU."""
    without = estimate(MEMCAP, "installed", {**base, "recompute_modules": list(modules)}).peak_rank
    with_ln = estimate(MEMCAP, "installed", {**base, "recompute_modules": [*modules, "layernorm"]}).peak_rank
    a, b = without.components, with_ln.components
    assert without.held == with_ln.held == [1]
    return {k: b.get(k, 0) - a.get(k, 0) for k in a.keys() | b.keys() if b.get(k, 0) != a.get(k, 0)}


@pytest.mark.parametrize("base, row", [(FP8_LINEARS, fp8_row), (FP4_ALL, mxfp4_row)], ids=["fp8", "fp4"])
def test_layernorm_recompute_drops_the_layernorm_readers_copies(base, row):
    """Under `layernorm` recompute our linears reading a LayerNorm output (qkv, dense and shared fc1)
    keep the BF16 tensor by reference, which the recompute discards, as Megatron's do: their FP8 /
    MXFP4 copies go, next to the router's BF16 LN output (already dropped before this change)."""
    per_layer = {"qkv_in": -T * row(H)}
    mlp = {"dense": {"fc1_in": -T * row(H)}, "moe": {"shared_fc1_in": -T * row(H), "router_in": -T * H * 2}}
    expected = {f"{p}.{k}": n * v for p, n in LAYERS.items()
                for k, v in {**per_layer, **mlp["dense" if p == "dense" else "moe"]}.items()}
    assert layernorm_recompute_moves(base) == expected


@pytest.mark.parametrize("base, row", [(FP8_LINEARS, fp8_row), (FP4_ALL, mxfp4_row)], ids=["fp8", "fp4"])
def test_layernorm_recompute_drops_both_mla_down_projections_copies(base, row):
    """MLA's q and kv down-projections both read the input LayerNorm output: two copies go; the
    up-projections and the output projection keep theirs."""
    moved = layernorm_recompute_moves({**base, **MLA})
    assert {k: v for k, v in moved.items() if k.endswith("down_in")} == {
        f"{p}.down_in": -n * 2 * T * row(H) for p, n in LAYERS.items()}
    assert not any(k.endswith(("up_in", "proj_in")) for k in moved)


def test_a_recomputed_role_keeps_its_own_copy_under_layernorm_recompute():
    """The rule holds only where the role's own module is not recomputed: a dense MLP under `mlp`
    recompute (shared experts under `shared_experts` or `moe`) restores its FP8 copy for backward,
    while a LayerNorm reader keeping the original gets the BF16 LayerNorm output back."""
    def restored(modules):
        e = estimate(MEMCAP, "installed", {**FP4_ALL, "recompute_modules": modules})
        ctx = Ctx(s=e.shape, par=e.parallel, p=e.precision, rc=e.recompute, tokens=T, rope=True, softmax_fp32=False,
                  ce_bytes=4, bias=False)
        roles = {role: ctx.keeps_layernorm_output(role) for role in (LinearRole.DENSE_MLP, LinearRole.SHARED_EXPERTS)}
        return roles, ctx.with_recompute(NONE)

    roles, ctx = restored(["layernorm"])
    assert roles == {LinearRole.DENSE_MLP: True, LinearRole.SHARED_EXPERTS: True}
    assert dense_mlp(ctx)["fc1_in"] == T * H * 2 and "shared_fc1_in" not in moe_mlp(ctx)
    roles, ctx = restored(["layernorm", "mlp", "shared_experts"])
    assert roles == {LinearRole.DENSE_MLP: False, LinearRole.SHARED_EXPERTS: False}
    assert dense_mlp(ctx)["fc1_in"] == moe_mlp(ctx)["shared_fc1_in"] == T * fp8_row(H)
    assert not restored(["layernorm", "moe"])[0][LinearRole.SHARED_EXPERTS]


def test_no_change_without_layernorm_recompute():
    """Without `layernorm` in the list (or under full recompute) our LayerNorm readers keep their copies."""
    for modules in (["core_attn"], ["core_attn", "mlp", "moe"]):
        c = components({**FP4_ALL, "recompute_modules": modules})
        assert c["dense.qkv_in"] == T * mxfp4_row(H)
    full = estimate(MEMCAP, "installed", {**FP4_ALL, "recompute_granularity": "full", "recompute_method": "uniform",
                                          "recompute_num_layers": 1})
    ctx = Ctx(s=full.shape, par=full.parallel, p=full.precision, rc=full.recompute, tokens=T, rope=True,
              softmax_fp32=False, ce_bytes=4, bias=False)
    assert not any(ctx.keeps_layernorm_output(role) for role in LinearRole)


@pytest.mark.parametrize("precision, row", [("fp8", fp8_row), ("fp4", mxfp4_row)])
def test_671b_first_scope_drops_the_down_projections_copies(precision, row):
    """At the paper's first scope, `layernorm` recompute takes from every decoder / MTP layer the
    two down-projections' copies of the LayerNorm output and the BF16 pre-MLP LayerNorm output the
    recomputed MLP / MoE layer would keep as its checkpoint's input, per micro-batch of a chunk."""
    config = DSV3 / f"{precision}_attn_ln_moe.yaml"
    with_ln = estimate(config)
    without = estimate(config, overrides={"recompute_modules": ["mla_up_proj", "mlp", "moe"]})
    s = with_ln.shape
    tokens = s.seq_length * s.micro_batch
    per_layer = tokens * (2 * row(s.hidden) + 2 * s.hidden)
    for rank in range(with_ln.parallel.pp):
        for chunk, a, b in zip(with_ln.parallel.chunks[rank], without.ranks[rank].chunk_bytes,
                               with_ln.ranks[rank].chunk_bytes):
            layers = sum(1 for kind, _ in chunk if kind in (DENSE, MOE, MTP))
            assert a - b == pytest.approx(layers * per_layer, rel=1e-9)


@pytest.mark.parametrize("attention", [{}, MLA], ids=["standard", "mla"])
@pytest.mark.parametrize("base, row", [(FP8_LINEARS, fp8_row), (FP4_ALL, mxfp4_row)], ids=["fp8", "fp4"])
def test_output_projection_keeps_the_fused_attentions_output_by_reference(base, row, attention):
    """The fused attention saves its BF16 output, and our output projection reads a view of it and
    keeps that: no copy of its own. Where that output is not saved it keeps its FP8 / MXFP4 copy:
    under core_attn recompute (the checkpoint runs attention without grad) and after the unfused
    DotProductAttention (which keeps the probabilities instead)."""
    projection = T * row(16 * 64)  # 16 heads of (value) dim 64, standard and MLA alike
    fused = {**base, **attention, "moe_fp4_fused_attention": True}
    for modules in (["mlp"], ["mla_up_proj", "layernorm"] if attention else ["layernorm"]):
        kept = components({**fused, "recompute_modules": modules})
        assert kept["dense.attn_out_bf16"] == T * 16 * 64 * 2
        assert not any(k.endswith(".proj_in") for k in kept), modules
    recomputed = components(fused)  # memcap_bf16_attn.yaml: core_attn
    assert "dense.attn_out_bf16" not in recomputed and recomputed["dense.proj_in"] == projection
    unfused = components({**base, **attention, "recompute_modules": ["mlp"]})
    assert "dense.attn_probs" in unfused and unfused["dense.proj_in"] == projection


def test_every_role_bf16_is_the_bf16_linears():
    """(The launcher refuses the combination; the estimator takes it.)"""
    every = estimate(MEMCAP, "installed", {**FP4_ALL, "moe_fp4_bf16_linears": ["attention", "mla_up_proj", "mlp",
                                                                              "shared_experts"]})
    bf16 = estimate(MEMCAP, "installed", {**FP4_ALL, "moe_fp4_linears": "bf16"})
    assert every.precision == bf16.precision
    assert every.peak_rank.components == bf16.peak_rank.components
    assert every.peak_rank.static == bf16.peak_rank.static and every.peak_gib == bf16.peak_gib


def test_the_recipe_row_keeps_every_role_fp8():
    flagged = {**FP4_ALL, "moe_fp4_bf16_linears": ["attention", "mlp"]}
    assert estimate(MEMCAP, "recipe", flagged).peak_gib == estimate(MEMCAP, "recipe", FP4_ALL).peak_gib
    assert components(flagged, "recipe") == components(FP4_ALL, "recipe")


@pytest.mark.parametrize("per_use", [False, True], ids=["cached", "weights-per-use"])
def test_backward_holds_the_largest_fp8_weight_transposed(per_use, monkeypatch):
    """Each backward phase holds the FP8 W^T of its largest data-gradient GEMM of ours, made from the
    cached W or quantized per use alike: attention, the qkv projection (3 x 1024 x 1024); the dense
    MLP, its fc1 (2 x 2816 x 1024), none with the MLP in BF16; an MoE layer's MLP, the 8 local
    experts' fc1 (8 x 2 x 2048 x 1024), larger than the shared expert's."""
    from megatron_fp4.estimator import activations

    def ctx(bf16_roles: dict):
        e = estimate(MEMCAP, "installed", {**FP4_ALL, **bf16_roles, "moe_fp4_weights_per_use": per_use})
        return Ctx(s=e.shape, par=e.parallel, p=e.precision, rc=e.recompute, tokens=T, rope=True, softmax_fp32=False,
                   ce_bytes=4, bias=False)

    qkv, fc1, experts = 3 * H * H * FP8_WEIGHT, 2 * FFN * H * FP8_WEIGHT, LOCAL_EXPERTS * 2 * MOE_FFN * H * FP8_WEIGHT
    assert activations.transposed_weight(ctx({}), DENSE) == pytest.approx((qkv, fc1), rel=1e-12)
    assert activations.transposed_weight(ctx({}), MOE) == pytest.approx((qkv, experts), rel=1e-12)
    assert activations.transposed_weight(ctx({"moe_fp4_bf16_linears": ["mlp"]}), DENSE) == (qkv, 0)
    # One term of the working set: here the attention phase (the unfused attention's score-sized
    # buffers) sets each layer's peak, which grows by qkv's W^T.
    with_it = {kind: backward_working_set(ctx({}), kind) for kind in (DENSE, MOE)}
    monkeypatch.setattr(activations, "transposed_weight", lambda c, kind: (0.0, 0.0))
    for kind in (DENSE, MOE):
        assert with_it[kind] - backward_working_set(ctx({}), kind) == pytest.approx(qkv, rel=1e-12)


def test_backward_makes_no_weight_transposed_when_the_step_keeps_them():
    """--moe-fp4-keep-transposed-weights: W^T is held for the step with W (static weights), so no
    backward phase makes one."""
    from megatron_fp4.estimator import activations

    e = estimate(MEMCAP, "installed", {**FP4_ALL, "moe_fp4_keep_transposed_weights": True})
    ctx = Ctx(s=e.shape, par=e.parallel, p=e.precision, rc=e.recompute, tokens=T, rope=True, softmax_fp32=False,
              ce_bytes=4, bias=False)
    assert e.precision.keep_transposed_weights
    assert activations.transposed_weight(ctx, DENSE) == activations.transposed_weight(ctx, MOE) == (0.0, 0.0)
