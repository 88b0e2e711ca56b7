"""--moe-fp4-fused-attention: FusedCoreAttention against Megatron's DotProductAttention on the same
q/k/v (forward and backward; standard, grouped-query and MLA-shaped heads; fp32 and bf16), its
refusals, the spec swap, an MLA layer built from the swapped local spec, and on a GPU that the fused
kernels serve the proxy's and DeepSeek-V3's shapes without keeping the probabilities."""

import contextlib
from types import SimpleNamespace

import pytest
import torch
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import _yarn_get_mscale
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_fp4.attention import FusedCoreAttention
from megatron_fp4.integration import use_fp4
from megatron_fp4.options import FP4Options, UnsupportedConfiguration

FUSED = FP4Options(fused_attention=True)
ONE_RANK = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))
# DeepSeek-V3's softmax scale: MLA's mscale^2 / sqrt(q/k head dim), rotary scaling factor 40.
DSV3_SCALE = _yarn_get_mscale(40, 1.0) ** 2 / 192 ** 0.5

# name: (heads, query groups, q/k head dim, v head dim, softmax scale or None for 1/sqrt(q/k dim))
SHAPES = {
    "standard": (4, 4, 32, 32, None),
    "gqa": (4, 2, 32, 32, None),
    "mla": (4, 4, 48, 32, _yarn_get_mscale(40, 1.0) ** 2 / 48 ** 0.5),
}


def _config(heads, groups, v_dim, dtype, **overrides):
    settings = dict(num_layers=1, hidden_size=heads * v_dim, num_attention_heads=heads, num_query_groups=groups,
                    kv_channels=v_dim, attention_dropout=0.0, hidden_dropout=0.0, masked_softmax_fusion=False,
                    bf16=dtype is torch.bfloat16, params_dtype=dtype, use_cpu_initialization=True)
    settings.update(overrides)
    return TransformerConfig(**settings)


def _qkv(heads, groups, qk_dim, v_dim, dtype, s=64, b=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(s, b, heads, qk_dim), (s, b, groups, qk_dim), (s, b, groups, v_dim)]
    return [torch.randn(*shape, generator=g).to(dtype) for shape in shapes]


def _run(module, q, k, v, grad, **kwargs):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = module(q, k, v, **kwargs)
    out.backward(grad)
    return [out.detach(), q.grad, k.grad, v.grad]


def _float64_truth(q, k, v, scale, grad):
    """Causal attention in float64, written out: the judge of both implementations."""
    q, k, v = (t.double().permute(1, 2, 0, 3).requires_grad_(True) for t in (q, k, v))
    leaves = [q, k, v]
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    s = scores.shape[-1]
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ v).permute(2, 0, 1, 3).reshape(s, q.shape[0], -1)
    out.backward(grad.double())
    return [out.detach()] + [t.grad.permute(2, 0, 1, 3) for t in leaves]


def _relative(actual, expected):
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


@pytest.fixture
def megatron_attention_on_cpu(model_parallel, monkeypatch):
    """Megatron's DotProductAttention, runnable on the CPU: its score buffer is allocated on
    torch.cuda.current_device(), and its dropout forks the CUDA RNG tracker (with dropout 0 no
    random number is drawn, so no tracker is needed)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda: SimpleNamespace(fork=contextlib.nullcontext))

    def build(config, scale):
        return DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                   attention_type="self", softmax_scale=scale, pg_collection=model_parallel)
    return build


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_megatrons_dot_product_attention(megatron_attention_on_cpu, shape, dtype):
    heads, groups, qk_dim, v_dim, scale = SHAPES[shape]
    config = _config(heads, groups, v_dim, dtype)
    ours = FusedCoreAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                              softmax_scale=scale, pg_collection=ONE_RANK, k_channels=qk_dim, v_channels=v_dim)
    stock = megatron_attention_on_cpu(config, scale)
    assert ours.softmax_scale == pytest.approx(stock.softmax_scale)
    q, k, v = _qkv(heads, groups, qk_dim, v_dim, dtype)
    grad = torch.randn(q.shape[0], q.shape[1], heads * v_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    # Megatron's local attention takes the causal mask from the data loader: bool [1, 1, s, s], True = masked.
    s = q.shape[0]
    causal_mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)
    got = _run(ours, q, k, v, grad, attention_mask=None)
    want = _run(stock, q, k, v, grad, attention_mask=causal_mask)
    names = ("output", "query grad", "key grad", "value grad")
    assert [t.shape for t in got] == [t.shape for t in want] and got[0].dtype == dtype
    if dtype is torch.float32:
        errors = {n: _relative(a, b) for n, a, b in zip(names, got, want)}
        assert max(errors.values()) < 1e-5, errors
    else:  # both round differently to bf16: judge each against float64
        truth = _float64_truth(q, k, v, stock.softmax_scale, grad)
        ours_err = {n: _relative(a, t) for n, a, t in zip(names, got, truth)}
        stock_err = {n: _relative(b, t) for n, b, t in zip(names, want, truth)}
        print({n: f"{ours_err[n]:.1e} vs {stock_err[n]:.1e}" for n in names})
        assert all(ours_err[n] < 1.5 * stock_err[n] for n in names), (ours_err, stock_err)


def test_mask_types_and_the_softmax_scale_default():
    config = _config(4, 4, 32, torch.float32)
    unmasked = FusedCoreAttention(config, 1, AttnMaskType.no_mask, "self", pg_collection=ONE_RANK)
    assert unmasked.softmax_scale == pytest.approx(32 ** -0.5) and unmasked.hidden_size_per_partition == 128
    q, k, v = _qkv(4, 4, 32, 32, torch.float32, s=16, b=1)
    full = unmasked(q, k, v, None)
    causal = unmasked(q, k, v, None, attn_mask_type=AttnMaskType.causal)
    # The last query sees every key in both; the first sees only itself under the causal mask.
    torch.testing.assert_close(full[-1], causal[-1])
    torch.testing.assert_close(causal[0], v[0].reshape(1, -1))


@pytest.mark.parametrize("overrides, kwargs, message", [
    (dict(attention_dropout=0.1), {}, "--attention-dropout 0"),
    ({}, dict(attention_dropout=0.1), "--attention-dropout 0"),
    (dict(softmax_type="off-by-one"), {}, "vanilla softmax"),
    (dict(window_size=(128, 0)), {}, "--window-size"),
    ({}, dict(attn_mask_type=AttnMaskType.padding), "padding mask"),
])
def test_constructor_refusals(overrides, kwargs, message):
    config = _config(4, 4, 32, torch.float32)
    for name, value in overrides.items():
        setattr(config, name, value)  # after TransformerConfig's own checks, which some of these would trip
    arguments = dict(attn_mask_type=AttnMaskType.causal, attention_type="self", pg_collection=ONE_RANK)
    arguments.update(kwargs)
    with pytest.raises(UnsupportedConfiguration, match=message):
        FusedCoreAttention(config, 1, **arguments)


def test_context_parallelism_is_refused():
    config = _config(4, 4, 32, torch.float32)
    config.context_parallel_size = 2
    with pytest.raises(UnsupportedConfiguration, match="--context-parallel-size 1"):
        FusedCoreAttention(config, 1, AttnMaskType.causal, "self", pg_collection=ONE_RANK)


@pytest.mark.parametrize("kwargs, message", [
    (dict(packed_seq_params=PackedSeqParams(qkv_format="thd")), "packed sequences"),
    (dict(attention_bias=torch.zeros(1)), "attention bias"),
    (dict(attn_mask_type=AttnMaskType.arbitrary), "arbitrary mask"),
    (dict(attn_mask_type=AttnMaskType.no_mask, attention_mask=torch.ones(1, 1, 16, 16, dtype=torch.bool)),
     "no_mask mask"),
])
def test_forward_refusals(kwargs, message):
    module = FusedCoreAttention(_config(4, 4, 32, torch.float32), 1, AttnMaskType.causal, "self",
                                pg_collection=ONE_RANK)
    q, k, v = _qkv(4, 4, 32, 32, torch.float32, s=16, b=1)
    kwargs.setdefault("attention_mask", None)
    with pytest.raises(UnsupportedConfiguration, match=message):
        module(q, k, v, **kwargs)
    with pytest.raises(UnsupportedConfiguration, match="one length"):  # causal needs square attention
        module(q[:4], k, v, None)


def test_spec_swap_and_switch_off():
    for mla in (False, True):
        spec = get_gpt_layer_local_spec(num_experts=4, multi_latent_attention=mla)
        assert use_fp4(spec, FP4Options()) is spec
        swapped = use_fp4(spec, FUSED)
        assert swapped.submodules.self_attention.submodules.core_attention is FusedCoreAttention
        assert spec.submodules.self_attention.submodules.core_attention is DotProductAttention  # untouched
    # With the FP8 linears: both swaps.
    swapped = use_fp4(get_gpt_layer_local_spec(num_experts=4, multi_latent_attention=True),
                      FP4Options(experts="fp8", linears="fp8", fused_attention=True))
    attention = swapped.submodules.self_attention.submodules
    assert attention.core_attention is FusedCoreAttention and attention.linear_proj.module.__name__ == \
        "FP8RowParallelLinear"


def test_spec_swap_refuses_another_core_attention():
    class OtherAttention(torch.nn.Module):
        pass

    spec = ModuleSpec(module=torch.nn.Module, submodules=SelfAttentionSubmodules(
        linear_qkv=None, core_attention=OtherAttention, linear_proj=None))
    with pytest.raises(UnsupportedConfiguration, match="--transformer-impl local"):
        use_fp4(spec, FUSED)


def test_an_mla_layer_from_the_swapped_local_spec_trains(model_parallel, monkeypatch):
    """MLA hands its core attention k_channels and v_channels, which megatron-core 0.19's
    DotProductAttention does not take (its local MLA spec fails to build); ours takes them."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    config = MLATransformerConfig(
        num_layers=1, hidden_size=128, num_attention_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_head_dim=32,
        qk_pos_emb_head_dim=16, v_head_dim=32, rope_type="yarn", rotary_scaling_factor=40, mscale=1.0,
        mscale_all_dim=1.0, attention_dropout=0.0, hidden_dropout=0.0, add_bias_linear=False,
        use_cpu_initialization=True, masked_softmax_fusion=False)
    stock = get_gpt_layer_local_spec(multi_latent_attention=True).submodules.self_attention
    with pytest.raises(TypeError, match="k_channels"):
        MLASelfAttention(config, stock.submodules, layer_number=1, attn_mask_type=AttnMaskType.causal,
                         pg_collection=model_parallel)
    ours = use_fp4(get_gpt_layer_local_spec(multi_latent_attention=True), FUSED).submodules.self_attention
    torch.manual_seed(0)
    layer = MLASelfAttention(config, ours.submodules, layer_number=1, attn_mask_type=AttnMaskType.causal,
                             pg_collection=model_parallel)
    core = layer.core_attention
    assert isinstance(core, FusedCoreAttention) and core.softmax_scale == pytest.approx(layer.softmax_scale)
    assert core.hidden_size_per_partition == 4 * 32
    hidden = torch.randn(24, 2, 128, requires_grad=True)
    out, _ = layer(hidden, attention_mask=None)
    out.sum().backward()
    assert out.shape == (24, 2, 128) and torch.isfinite(hidden.grad).all()


def _backends_serving(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    serving = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        try:
            with sdpa_kernel(backend):
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.sum().backward()
            serving.append(backend.name)
        except RuntimeError:
            pass
    return serving


@pytest.mark.gpu
@pytest.mark.parametrize("name, b, heads, s, qk_dim, v_dim, scale", [
    ("proxy", 4, 16, 1024, 64, 64, None),
    ("DeepSeek-V3 MLA", 1, 128, 4096, 192, 128, DSV3_SCALE),
])
def test_fused_kernels_serve_the_runs_shapes_without_the_probabilities(name, b, heads, s, qk_dim, v_dim, scale):
    device = torch.device("cuda")
    config = _config(heads, heads, v_dim, torch.bfloat16)
    module = FusedCoreAttention(config, 1, AttnMaskType.causal, "self", softmax_scale=scale, pg_collection=ONE_RANK,
                                k_channels=qk_dim, v_channels=v_dim)
    q, k, v = (t.to(device).requires_grad_(True) for t in _qkv(heads, heads, qk_dim, v_dim, torch.bfloat16, s=s, b=b))
    serving = _backends_serving(*(t.detach().permute(1, 2, 0, 3).requires_grad_(True) for t in (q, k, v)))
    print(f"{name}: fused backends accepting q/k {qk_dim}, v {v_dim}: {serving}")
    assert serving
    grad = torch.randn(s, b, heads * v_dim, device=device, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = module(q, k, v, None)
    out.backward(grad)
    torch.cuda.synchronize()
    added = torch.cuda.max_memory_allocated() - before
    probabilities = b * heads * s * s * 2
    # What any kernel allocates: the output, the three input gradients and contiguous copies of the
    # inputs (measured on H200: 1028 MiB for the MLA shapes, whose BF16 probabilities alone are 4 GiB,
    # so a bound of a quarter of the probabilities was wrong for them). Materialized probabilities
    # would add b x heads x s x s elements on top.
    operands = sum(t.numel() * t.element_size() for t in (q, k, v)) + out.numel() * out.element_size()
    print(f"{name}: forward+backward added {added / 2**20:.0f} MiB; operands {operands / 2**20:.0f} MiB; the "
          f"probabilities alone are {probabilities / 2**20:.0f} MiB")
    assert added < 3 * operands + probabilities / 16
    assert torch.isfinite(out).all() and all(torch.isfinite(t.grad).all() for t in (q, k, v))
