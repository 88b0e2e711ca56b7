"""FP8Experts on one rank: the math against a float64 oracle of the same quantization
steps, the error against unquantized float64 math, what is saved for backward, that it is freed,
the checkpoint keys, the spec swap and the refusals. On CPU the kernels run under the interpreter
and the GEMMs are emulated in fp32; on a GPU the same tests run scaled_mm."""

import contextlib
import functools
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

from megatron_fp4 import reference as ref
from megatron_fp4.experts import FP8Experts
from megatron_fp4.formats import mxfp4_wire_bytes_per_row
from megatron_fp4.layout import colwise_capacity
from megatron_fp4.integration.experts_spec import use_fp8_experts
from megatron_fp4.options import FP4Options

from support.experts_reference import fp8_experts_oracle

HIDDEN, FFN, EXPERTS = 256, 128, 4
COUNTS = [130, 0, 70, 1]  # a segment over 128 tokens, an empty expert, a single token


def _config(**overrides):
    settings = dict(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, num_moe_experts=EXPERTS, moe_router_topk=2,
        moe_ffn_hidden_size=FFN, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        use_cpu_initialization=True, bf16=True, params_dtype=torch.bfloat16, gradient_accumulation_fusion=False,
    )
    settings.update(overrides)
    return TransformerConfig(**settings)


def _experts_builder(kind: str):
    spec = use_fp8_experts(get_gpt_layer_local_spec(num_experts=EXPERTS), FP4Options(experts=kind))
    return spec.submodules.mlp.keywords["submodules"].experts


def _build(pg_collection, device, kind="fp8", seed=3, **overrides):
    torch.manual_seed(seed)
    return _spread_weights(_experts_builder(kind)(EXPERTS, _config(**overrides), pg_collection=pg_collection).to(device))


def _spread_weights(experts):
    """Megatron initializes weights with std 0.02; spread them over a few binades so that the
    128x128 blocks get different scales."""
    with torch.no_grad():
        for p in experts.parameters():
            p.mul_(torch.exp2(torch.randint(-3, 4, p.shape[:1], device=p.device).float()).unsqueeze(1).to(p.dtype))
    return experts


def _inputs(device, seed=5, hidden=HIDDEN):
    g = torch.Generator().manual_seed(seed)
    tokens = sum(COUNTS)
    raw = torch.randn(tokens, hidden, generator=g) * torch.exp2(torch.randint(-4, 4, (tokens, hidden), generator=g).float())
    payload = ref.quantize_mxfp4(raw.bfloat16().to(device))
    probs = torch.rand(tokens, generator=g).to(device)
    grad = (torch.randn(tokens, hidden, generator=g) * 0.1).bfloat16().to(device)
    return payload, probs, grad


def _run(experts, received, probs, grad, payload=None):
    experts.zero_grad(set_to_none=True)
    x = received.clone().requires_grad_(True)
    p = probs.clone().requires_grad_(True)
    out, bias = experts(x, torch.tensor(COUNTS), p, payload=payload)
    assert bias is None
    out.backward(grad)
    return out.detach(), x.grad, p.grad, experts


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double().cpu()
    return ((actual.double().cpu() - expected).norm() / expected.norm()).item()


def _compare(result, oracle, experts, bound):
    out, grad_x, grad_p, _ = result
    errors = {"output": _relative(out, oracle.output), "input grad": _relative(grad_x, oracle.grad_input),
              "probs grad": _relative(grad_p, oracle.grad_probs)}
    for e, expert in enumerate(experts.local_experts):
        if COUNTS[e]:
            errors[f"fc1 grad {e}"] = _relative(expert.linear_fc1.weight.grad, oracle.grad_fc1[e])
            errors[f"fc2 grad {e}"] = _relative(expert.linear_fc2.weight.grad, oracle.grad_fc2[e])
        else:  # no tokens: a zero gradient, not None (DDP expects one)
            assert not expert.linear_fc1.weight.grad.any() and not expert.linear_fc2.weight.grad.any()
    print({k: f"{v:.1e}" for k, v in errors.items()})
    worst = max(errors, key=errors.get)
    assert errors[worst] < bound, (worst, errors[worst])
    return errors


def _weights(experts):
    fc1 = [e.linear_fc1.weight.detach().cpu() for e in experts.local_experts]
    fc2 = [e.linear_fc2.weight.detach().cpu() for e in experts.local_experts]
    return fc1, fc2


@pytest.mark.parametrize("from_payload, offset", [(True, 0.0), (False, 0.0), (True, 0.5)],
                         ids=["fp4-payload", "bf16-input", "fp4-payload-glu-offset"])
def test_matches_the_float64_oracle_of_the_same_quantization(model_parallel, device, from_payload, offset):
    experts = _build(model_parallel, device, glu_linear_offset=offset)
    payload, probs, grad = _inputs(device)
    received = ref.dequantize_mxfp4(payload)
    result = _run(experts, received, probs, grad, payload if from_payload else None)
    cpu_payload = ref.quantize_mxfp4(received.cpu()) if from_payload else None
    oracle = fp8_experts_oracle(received.cpu(), cpu_payload, COUNTS, probs.cpu(), *_weights(experts), grad.cpu(),
                                offset)
    # Only the accumulation order and precision differ (fp32 vs float64 on CPU: ~1e-5). On a GPU the
    # tensor cores accumulate differently still, and an output one BF16 unit away from the oracle's
    # can flip a downstream FP8 or MXFP4 rounding (an MXFP4 step is up to a third of the value): the
    # chained fc1 weight gradient measured 7.8e-3 and 8.4e-3 on H200 from the payload, 2e-3 from BF16.
    # Either way far below the quantization error itself (0.2, next test).
    _compare(result, oracle, experts, bound=2e-2 if device.type == "cuda" else 1e-3)


def test_error_against_unquantized_math_is_within_fp8_and_fp4_expectations(model_parallel, device):
    """The whole recipe against float64 math on the same (FP4-rounded) input: FP8 operands give a
    few percent; the MXFP4-saved SwiGLU and fc2 inputs add more to the gradients."""
    experts = _build(model_parallel, device)
    payload, probs, grad = _inputs(device)
    received = ref.dequantize_mxfp4(payload)
    result = _run(experts, received, probs, grad, payload)

    x = received.cpu().double().requires_grad_(True)
    p = probs.cpu().double().requires_grad_(True)
    fc1, fc2 = [[w.double().requires_grad_(True) for w in ws] for ws in _weights(experts)]
    outs, start = [], 0
    for e, n in enumerate(COUNTS):
        gate, linear = (x[start : start + n] @ fc1[e].t()).chunk(2, dim=-1)
        outs.append((F.silu(gate) * linear * p[start : start + n, None]) @ fc2[e].t())
        start += n
    torch.cat(outs).backward(grad.cpu().double())
    errors = {"output": _relative(result[0], torch.cat(outs).detach()), "input grad": _relative(result[1], x.grad),
              "probs grad": _relative(result[2], p.grad)}
    for e, expert in enumerate(experts.local_experts):
        if COUNTS[e] > 1:
            errors[f"fc1 grad {e}"] = _relative(expert.linear_fc1.weight.grad, fc1[e].grad)
            errors[f"fc2 grad {e}"] = _relative(expert.linear_fc2.weight.grad, fc2[e].grad)
    print({k: f"{v:.1e}" for k, v in errors.items()})
    assert errors["output"] < 0.08
    assert max(errors.values()) < 0.25, errors


@contextlib.contextmanager
def _saved_activations(experts):
    """The tensors a forward inside saves for backward, the experts' parameters left out."""
    params = {id(p) for p in experts.parameters()}
    saved = []

    def pack(t):
        if id(t) not in params:
            saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved


def test_saves_only_fp4_and_frees_it_after_backward(model_parallel, device):
    experts = _build(model_parallel, device)
    payload, probs, grad = _inputs(device)
    x = ref.dequantize_mxfp4(payload).requires_grad_(True)
    with _saved_activations(experts) as activations:
        out, _ = experts(x, torch.tensor(COUNTS), probs.clone().requires_grad_(True), payload=payload)
    saved = [(t.dtype, t.numel() * t.element_size(), weakref.ref(t)) for t in activations]
    del activations
    tokens = sum(COUNTS)
    expected = tokens * (mxfp4_wire_bytes_per_row(HIDDEN) + mxfp4_wire_bytes_per_row(2 * FFN)
                         + mxfp4_wire_bytes_per_row(FFN))
    assert sorted(str(dtype) for dtype, _, _ in saved) == sorted(map(str, [torch.uint8] * 3 + [probs.dtype]))
    assert sum(size for dtype, size, _ in saved if dtype == torch.uint8) == expected
    # BF16 would hold 2 bytes per element of the same three tensors: FP4 keeps 26.6% of that.
    assert expected / (tokens * 2 * (HIDDEN + 3 * FFN)) < 0.27
    out.backward(grad)
    del payload, x
    gc.collect()
    assert all(ref_() is None for dtype, _, ref_ in saved if dtype == torch.uint8), "saved FP4 kept after backward"


def test_fp8_baseline_saves_fp8_columns_and_the_bf16_swiglu_input(model_parallel, device):
    """Without a payload the experts keep what their weight gradients read, as Transformer Engine's
    FP8 layers do: FP8 columns of the fc1 and fc2 inputs (1 byte per element, each expert's tokens
    padded to 128, fp32 scales per 128 tokens), and the SwiGLU input in BF16; not the BF16 tokens."""
    experts = _build(model_parallel, device)
    payload, probs, _ = _inputs(device)
    x = ref.dequantize_mxfp4(payload).requires_grad_(True)
    with _saved_activations(experts) as saved:
        experts(x, torch.tensor(COUNTS), probs.clone().requires_grad_(True))
    capacity = colwise_capacity(sum(COUNTS), EXPERTS)  # room for every segment rounded up to 128, known on the host
    shapes = sorted((str(t.dtype), tuple(t.shape)) for t in saved if t.dim() == 2)
    assert shapes == sorted([("torch.bfloat16", (sum(COUNTS), 2 * FFN)),
                             ("torch.float8_e4m3fn", (HIDDEN, capacity)), ("torch.float8_e4m3fn", (FFN, capacity)),
                             ("torch.float32", (capacity // 128, HIDDEN)), ("torch.float32", (capacity // 128, FFN))])


@pytest.mark.parametrize("storage, recompute", [("experts", dict(recompute_granularity="selective",
                                                                  recompute_modules=["moe"])), ("none", {})],
                         ids=["moe-recompute", "storage-none"])
def test_only_the_exact_payload_is_kept_in_fp4_inside_moe_recompute_or_with_storage_none(
        model_parallel, device, storage, recompute):
    """Under `moe` recompute the experts run inside Megatron's checkpoint, and --moe-fp4-storage none
    asks for the same everywhere: the payload (exact FP4 values) is kept, the SwiGLU input in BF16
    and the fc2 input as FP8 columns, not in MXFP4; the math is the oracle's with those saved tensors."""
    torch.manual_seed(3)
    options = FP4Options(dispatch=True, experts="fp8", storage=storage)
    builder = use_fp8_experts(get_gpt_layer_local_spec(num_experts=EXPERTS), options).submodules.mlp.keywords[
        "submodules"].experts
    config = _config(moe_token_dispatcher_type="alltoall", **recompute)  # the MXFP4 dispatch replaces its all-to-all
    experts = _spread_weights(builder(EXPERTS, config, pg_collection=model_parallel).to(device))
    payload, probs, grad = _inputs(device)
    received = ref.dequantize_mxfp4(payload)
    x = received.clone().requires_grad_(True)
    with _saved_activations(experts) as saved:
        experts(x, torch.tensor(COUNTS), probs.clone().requires_grad_(True), payload=payload)
    kinds = sorted((str(t.dtype), tuple(t.shape)) for t in saved if t.dim() == 2)
    capacity = colwise_capacity(sum(COUNTS), EXPERTS)
    assert kinds == sorted([("torch.uint8", tuple(payload.rows.shape)), ("torch.bfloat16", (sum(COUNTS), 2 * FFN)),
                            ("torch.float8_e4m3fn", (FFN, capacity)), ("torch.float32", (capacity // 128, FFN))])
    del saved
    result = _run(experts, received, probs, grad, payload)
    oracle = fp8_experts_oracle(received.cpu(), ref.quantize_mxfp4(received.cpu()), COUNTS, probs.cpu(),
                                *_weights(experts), grad.cpu(), fp4_activations=False)
    _compare(result, oracle, experts, bound=2e-2 if device.type == "cuda" else 1e-3)


def test_weight_gradients_accumulate_in_main_grad_when_fused(model_parallel, device):
    experts = _build(model_parallel, device)
    fused = _build(model_parallel, device, gradient_accumulation_fusion=True)
    payload, probs, grad = _inputs(device)
    received = ref.dequantize_mxfp4(payload)
    _run(experts, received, probs, grad, payload)
    for p in fused.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=device)
        p.grad_added_to_main_grad = False
    _run(fused, received, probs, grad, payload)
    first = {name: p.main_grad.clone() for name, p in fused.named_parameters()}
    _run(fused, received, probs, grad, payload)  # a second micro-batch adds the same sums
    for (name, p), p_fused in zip(experts.named_parameters(), fused.parameters()):
        assert p_fused.grad_added_to_main_grad, name
        # The fp32 sums go into main_grad unrounded; the unfused gradient is their BF16 rounding.
        assert torch.equal(first[name].to(p.grad.dtype), p.grad), name
        assert torch.equal(p_fused.main_grad, 2 * first[name]), name
    assert any(not torch.equal(g, g.bfloat16().float()) for g in first.values()), "main_grad was rounded to BF16"


def test_per_expert_gemms_match_the_grouped_ones(model_parallel, device):
    """ExpertGemms.PER_EXPERT (cuBLASLt per expert; emulated on CPU) against the grouped kernels:
    the same block-scaled products, summed in another order (and its wgrad rounded to BF16)."""
    from megatron_fp4.experts import ExpertGemms

    payload, probs, grad = _inputs(device)
    received = ref.dequantize_mxfp4(payload)
    grouped = _build(model_parallel, device)
    per_expert = _build(model_parallel, device)
    per_expert.gemms = ExpertGemms.PER_EXPERT
    expected = _run(grouped, received, probs, grad, payload)
    result = _run(per_expert, received, probs, grad, payload)
    for name, a, b in [("output", result[0], expected[0]), ("input grad", result[1], expected[1]),
                       ("probs grad", result[2], expected[2])]:
        assert _relative(a, b) < 2e-2, name
    for e, count in enumerate(COUNTS):
        for fc in ("linear_fc1", "linear_fc2"):
            ours, theirs = (getattr(m.local_experts[e], fc).weight.grad for m in (per_expert, grouped))
            if count:
                assert _relative(ours, theirs) < 2e-2, (e, fc)
            else:
                assert not ours.any() and not theirs.any(), (e, fc)


@pytest.mark.gpu
def test_the_cuda_gemms_give_the_triton_gemms_bits(model_parallel, device):
    """On an SM90 GPU the grouped GEMMs default to the CUDA kernels for the forward GEMMs and weight
    gradients (the data gradients run on the Triton kernel: DATA_GRADIENT_BACKEND; the kernel tests
    compare the CUDA kernel on those shapes): the layer's output, input and probs gradients and weight
    gradients equal those of the Triton kernels (ExpertGemms.GROUPED_TRITON) bit for bit."""
    from megatron_fp4.experts import ExpertGemms

    payload, probs, grad = _inputs(device, hidden=512)
    received = ref.dequantize_mxfp4(payload)
    layers = {}
    for gemms in (ExpertGemms.GROUPED, ExpertGemms.GROUPED_TRITON):
        layers[gemms] = _build(model_parallel, device, hidden_size=512)
        layers[gemms].gemms = gemms
    expected = _run(layers[ExpertGemms.GROUPED_TRITON], received, probs, grad, payload)
    result = _run(layers[ExpertGemms.GROUPED], received, probs, grad, payload)
    for name, a, b in [("output", result[0], expected[0]), ("input grad", result[1], expected[1]),
                       ("probs grad", result[2], expected[2])]:
        assert torch.equal(a, b), name
    for e in range(len(COUNTS)):
        for fc in ("linear_fc1", "linear_fc2"):
            ours, theirs = (getattr(m.local_experts[e], fc).weight.grad
                            for m in (layers[ExpertGemms.GROUPED], layers[ExpertGemms.GROUPED_TRITON]))
            assert torch.equal(ours, theirs), (e, fc)


@pytest.mark.parametrize("gemms", ["grouped", "grouped_triton"])
def test_grouped_gemms_name_their_backend(model_parallel, device, monkeypatch, gemms):
    """ExpertGemms.GROUPED: the forward GEMMs and weight gradients leave the backend to the kernels'
    default (None: the CUDA kernels on SM90), the two data gradients run on DATA_GRADIENT_BACKEND (the
    Triton kernel, faster there); GROUPED_TRITON: every GEMM on the Triton kernels. Tiles are always
    the backend's defaults."""
    from megatron_fp4 import kernels as K
    from megatron_fp4.experts import ExpertGemms
    from megatron_fp4.experts.function import DATA_GRADIENT_BACKEND
    from megatron_fp4.kernels import GemmBackend

    payload, probs, grad = _inputs(device)
    layer = _build(model_parallel, device)
    assert layer.gemms is ExpertGemms.GROUPED
    layer.gemms = ExpertGemms(gemms)
    asked = {"rows": [], "wgrad": []}
    real_rows, real_wgrad = K.grouped_gemm_by_weight, K.grouped_wgrad

    def spy(kind, real):
        return lambda *a, tiles=None, backend=None, **k: asked[kind].append((tiles, backend)) or real(
            *a, tiles=tiles, backend=backend, **k)

    monkeypatch.setattr(K, "grouped_gemm_by_weight", spy("rows", real_rows))
    monkeypatch.setattr(K, "grouped_wgrad", spy("wgrad", real_wgrad))
    _run(layer, ref.dequantize_mxfp4(payload), probs, grad, payload)
    if layer.gemms is ExpertGemms.GROUPED:
        assert DATA_GRADIENT_BACKEND is GemmBackend.TRITON
        assert asked["rows"] == [(None, None)] * 2 + [(None, DATA_GRADIENT_BACKEND)] * 2
        assert asked["wgrad"] == [(None, None)] * 2
    else:
        assert asked["rows"] == [(None, GemmBackend.TRITON)] * 4 and asked["wgrad"] == [(None, GemmBackend.TRITON)] * 2


def test_weights_quantized_once_per_step_unless_per_use(model_parallel, device, monkeypatch):
    """Two forwards and backwards with the same weights quantize W of fc1 and fc2 once and take W^T
    from it in each backward by transposing its blocks (only in the first backward with
    --moe-fp4-keep-transposed-weights); with --moe-fp4-weights-per-use W and W^T are quantized at every
    use. All give the same bits."""
    from megatron_fp4 import kernels as K

    payload, probs, grad = _inputs(device)
    real, real_transpose = K.quantize_fp8_weights_stacked, K.transpose_fp8_weights

    def two_steps(per_use: bool, keep_transposed: bool = False):
        """(transpose flag of each quantization, outputs and gradients of two forwards and backwards)."""
        torch.manual_seed(3)
        options = FP4Options(experts="fp8", weights_per_use=per_use, keep_transposed_weights=keep_transposed)
        experts = FP8Experts(EXPERTS, _config(), _experts_builder("fp8").keywords["submodules"],
                             pg_collection=model_parallel, options=options).to(device)
        assert (experts.weight_cache is None) == per_use
        calls = []
        monkeypatch.setattr(K, "quantize_fp8_weights_stacked", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
        monkeypatch.setattr(K, "transpose_fp8_weights", lambda w: calls.append("T") or real_transpose(w))
        results = [_run(experts, ref.dequantize_mxfp4(payload), probs, grad, payload)[:3] for _ in range(2)]
        return calls, results + [[p.grad for p in experts.parameters()]]

    (cached_calls, cached), (per_use_calls, per_use) = two_steps(False), two_steps(True)
    kept_calls, kept = two_steps(False, keep_transposed=True)
    assert cached_calls == [False, False] + ["T", "T"] * 2  # fc1, fc2 forward once; fc2, fc1 backward
    assert kept_calls == [False, False, "T", "T"]  # W^T of fc2, fc1 in the first backward only
    assert per_use_calls == [False, False, True, True] * 2  # fc1, fc2 forward; fc2, fc1 backward
    for other in (per_use, kept):
        for ours, theirs in zip(cached, other):
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_checkpoint_keys_and_shapes_are_sequential_mlps(model_parallel, device):
    ours = _build(model_parallel, device, "fp8")
    megatron = _build(model_parallel, device, "bf16", seed=4)
    assert type(megatron).__name__ == "SequentialMLP" and isinstance(ours, FP8Experts)
    sharded_ours, sharded_megatron = ours.sharded_state_dict(), megatron.sharded_state_dict()
    assert sorted(sharded_ours) == sorted(sharded_megatron)
    def layout(entry):  # a ShardedTensor, or the SwiGLU factory Megatron uses for fc1
        if hasattr(entry, "local_shape"):
            return type(entry), entry.key, entry.local_shape, entry.global_shape, entry.global_offset
        if hasattr(entry, "global_shape"):  # ShardedObject (e.g. extra state)
            return type(entry), entry.key, entry.global_shape, entry.global_offset
        return type(entry), entry.key, tuple(entry.data.shape), entry.replica_id

    for key, entry in sharded_ours.items():
        assert layout(entry) == layout(sharded_megatron[key]), key
    # And the plain state dicts load into each other.
    megatron.load_state_dict(ours.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), megatron.parameters()))


def test_spec_swap_and_switch_off():
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS)
    assert use_fp8_experts(spec, FP4Options()) is spec
    options = FP4Options(experts="fp8", scale_rule="floor")
    swapped = use_fp8_experts(spec, options).submodules.mlp.keywords["submodules"].experts
    assert isinstance(swapped, functools.partial) and swapped.func is FP8Experts
    assert swapped.keywords["options"] is options
    assert spec.submodules.mlp.keywords["submodules"].experts.func.__name__ == "SequentialMLP"
    with pytest.raises(ValueError, match="fp4"):
        FP4Options(experts="fp4")


@pytest.mark.parametrize("overrides, message", [
    (dict(gated_linear_unit=False), "SwiGLU"),
    (dict(activation_func=F.gelu), "SwiGLU"),
    (dict(add_bias_linear=True), "bias"),
    (dict(moe_apply_probs_on_input=True, moe_router_topk=1, moe_router_pre_softmax=True), "apply-probs-on-input"),
    (dict(moe_ffn_hidden_size=192), "--moe-ffn-hidden-size divisible by 128"),
])
def test_refusals(model_parallel, overrides, message):
    with pytest.raises(ValueError, match=message):
        _build(model_parallel, "cpu", **overrides)


def test_refuses_a_payload_for_other_tokens(model_parallel, device):
    experts = _build(model_parallel, device)
    payload, probs, _ = _inputs(device)
    x = ref.dequantize_mxfp4(payload)
    with pytest.raises(ValueError, match="does not match the tokens"):
        experts(x[1:], torch.tensor(COUNTS), probs[1:], payload=payload)
    with pytest.raises(ValueError, match="does not describe"):
        experts(x, torch.tensor([1, 2, 3, 4]), probs, payload=payload)


@pytest.mark.gpu  # megatron.core.dist_checkpointing needs CUDA
def test_distributed_checkpoint_round_trip_with_sequential_mlp(model_parallel, device, tmp_path):
    """A dist checkpoint saved from FP8Experts loads into Megatron's SequentialMLP, and back."""
    from megatron.core import dist_checkpointing

    ours = _build(model_parallel, device, "fp8", seed=11)
    megatron = _build(model_parallel, device, "bf16", seed=12)
    assert not all(torch.equal(a, b) for a, b in zip(ours.parameters(), megatron.parameters()))
    (tmp_path / "fp8").mkdir()
    (tmp_path / "bf16").mkdir()
    dist_checkpointing.save(ours.sharded_state_dict(prefix="experts."), str(tmp_path / "fp8"))
    megatron.load_state_dict(
        {k.removeprefix("experts."): v for k, v in
         dist_checkpointing.load(megatron.sharded_state_dict(prefix="experts."), str(tmp_path / "fp8")).items()})
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), megatron.parameters()))

    with torch.no_grad():
        for p in megatron.parameters():
            p.mul_(2)
    dist_checkpointing.save(megatron.sharded_state_dict(prefix="experts."), str(tmp_path / "bf16"))
    ours.load_state_dict(
        {k.removeprefix("experts."): v for k, v in
         dist_checkpointing.load(ours.sharded_state_dict(prefix="experts."), str(tmp_path / "bf16")).items()})
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), megatron.parameters()))


def test_no_grad_forward_saves_nothing_and_gives_the_same_output(model_parallel, device, monkeypatch):
    import megatron_fp4.experts.function as function

    experts = _build(model_parallel, device)
    payload, probs, grad = _inputs(device)
    received = ref.dequantize_mxfp4(payload)
    with_grad = _run(experts, received, probs, grad, payload)[0]
    asked = []  # what the SwiGLU kernel was asked to write besides the FP8 rows
    real_swiglu = function.swiglu_quantized

    def recording_swiglu(*args, keep_values, mxfp4_rule):
        out = real_swiglu(*args, keep_values=keep_values, mxfp4_rule=mxfp4_rule)
        asked.append((out.values is not None, None if out.fc1_out_mxfp4 is None else out.fc1_out_mxfp4.shape,
                      None if out.fc2_in_mxfp4 is None else out.fc2_in_mxfp4.shape))
        return out

    monkeypatch.setattr(function, "swiglu_quantized", recording_swiglu)
    with torch.no_grad():
        out, _ = experts(received, torch.tensor(COUNTS), probs, payload=payload)
    assert out.grad_fn is None and torch.equal(out, with_grad)
    assert asked == [(False, None, None)]  # nothing kept for a backward that will not come
    # With grad: MXFP4 copies of the SwiGLU input and the fc2 input, no BF16 values.
    asked.clear()
    _run(experts, received, probs, grad, payload)
    assert asked == [(False, (sum(COUNTS), 2 * FFN), (sum(COUNTS), FFN))]


def test_runs_the_weight_holders_forward_pre_hooks(model_parallel, device):
    """Megatron's DDP waits for --overlap-param-gather's all-gather in the linear layers' forward
    pre-hooks; the experts read those weights without calling the layers, so they run the hooks."""
    experts = _build(model_parallel, device)
    payload, probs, grad = _inputs(device)
    calls = []
    for expert in experts.local_experts:
        for holder in (expert.linear_fc1, expert.linear_fc2):
            holder.register_forward_pre_hook(lambda module, args: calls.append(module))
    _run(experts, ref.dequantize_mxfp4(payload), probs, grad, payload)
    assert len(calls) == 2 * EXPERTS and len({id(m) for m in calls}) == 2 * EXPERTS


def test_a_rank_without_tokens(model_parallel, device):
    experts = _build(model_parallel, device)
    x = torch.zeros(0, HIDDEN, dtype=torch.bfloat16, device=device, requires_grad=True)
    probs = torch.zeros(0, device=device, requires_grad=True)
    out, _ = experts(x, torch.tensor([0] * EXPERTS), probs)
    out.sum().backward()  # an expanded (stride 0) gradient
    assert out.shape == (0, HIDDEN) and x.grad.shape == (0, HIDDEN)
    assert all(p.grad is not None and not p.grad.any() for p in experts.parameters())


def test_rows_segment_pads_m_to_a_multiple_of_4(device):
    """cuBLASLt refuses M % 4 != 0: segments borrow the next tokens' rows, or zeros at the end."""
    from megatron_fp4.fp8.gemm import rows_segment

    t = ref.quantize_fp8_rows(torch.randn(10, 256, device=device))
    a, scale_a = rows_segment(t, 2, 5)  # 3 rows -> 4: row 5 borrowed
    assert a.shape == (4, 256) and scale_a.shape == (4, 2) and scale_a.stride() == (1, 4)
    assert torch.equal(a.view(torch.uint8), t.data[2:6].view(torch.uint8))
    a, scale_a = rows_segment(t, 7, 10)  # 3 rows at the end -> one zero row with scale 1
    assert a.shape == (4, 256) and torch.equal(a[:3].view(torch.uint8), t.data[7:].view(torch.uint8))
    assert not a[3].view(torch.uint8).any() and (scale_a[3] == 1.0).all()
    assert torch.equal(scale_a[:3], t.block_scales[:, 7:].t())
    # One scale column (K = 128): strides (1, M) all the same, which scaled_mm checks.
    a, scale_a = rows_segment(ref.quantize_fp8_rows(torch.randn(10, 128, device=device)), 0, 6)
    assert scale_a.shape == (8, 1) and scale_a.stride() == (1, 8)


def test_rows_segments_share_one_scale_buffer_without_overlap(device):
    """All experts' segments at once (one allocation): each segment's scales are its own columns,
    laid out [K/128, M] with strides (1, M), and the last one is padded with a zero row of scale 1."""
    from megatron_fp4.fp8.gemm import rows_segments

    t = ref.quantize_fp8_rows(torch.randn(23, 384, device=device))
    bounds = [(0, 5), (5, 6), (6, 14), (14, 23)]  # M 5, 1, 8, 9 -> 8, 4, 8, 12 (the last runs past the end)
    segments = rows_segments(t, bounds)
    for (start, end), (a, scale_a) in zip(bounds, segments):
        m = a.shape[0]
        assert m % 4 == 0 and m - (end - start) < 4
        assert scale_a.shape == (m, 3) and scale_a.stride() == (1, m)
        kept = min(start + m, 23) - start
        assert torch.equal(a[:kept].view(torch.uint8), t.data[start : start + kept].view(torch.uint8))
        assert torch.equal(scale_a[:kept], t.block_scales[:, start : start + kept].t())
    a, scale_a = segments[-1]
    assert not a[9:].view(torch.uint8).any() and (scale_a[9:] == 1.0).all()
    pointers = sorted((s.data_ptr(), s.data_ptr() + s.numel() * 4) for _, s in segments)
    assert all(end <= start for (_, end), (start, _) in zip(pointers, pointers[1:]))


def test_gemm_contract_is_checked_on_every_device(device):
    """The CPU emulation refuses what scaled_mm would: M not a multiple of 4, wrong scale strides."""
    from megatron_fp4.fp8.gemm import gemm_by_weight, rows_segment

    x = ref.quantize_fp8_rows(torch.randn(8, 256, device=device))
    w = ref.quantize_fp8_weight(torch.randn(128, 256, device=device))
    assert gemm_by_weight(*rows_segment(x, 0, 3), w).shape == (4, 128)
    with pytest.raises(RuntimeError, match="M a multiple of 4"):
        gemm_by_weight(x.data[:3], x.block_scales[:, :3].contiguous().t(), w)
    with pytest.raises(RuntimeError, match="scale_a must be"):
        gemm_by_weight(x.data[:4], x.block_scales.t()[:4], w)  # leading stride 8, not 4


def test_telemetry_counts_the_saved_fp4_until_backward_has_used_it(model_parallel, device):
    from megatron_fp4.telemetry import Telemetry

    experts = _build(model_parallel, device)
    payload, probs, grad = _inputs(device)
    x = ref.dequantize_mxfp4(payload).requires_grad_(True)
    telemetry = Telemetry()
    out, _ = experts(x, torch.tensor(COUNTS), probs, payload=payload, telemetry=telemetry)
    expected = sum(COUNTS) * (mxfp4_wire_bytes_per_row(HIDDEN) + mxfp4_wire_bytes_per_row(2 * FFN)
                              + mxfp4_wire_bytes_per_row(FFN))  # what the test above finds saved
    assert telemetry.held_bytes == expected
    out.backward(grad)
    assert telemetry.held_bytes == 0
    with torch.no_grad():  # nothing saved, nothing counted
        experts(x, torch.tensor(COUNTS), probs, payload=payload, telemetry=telemetry)
    experts(x, torch.tensor(COUNTS), probs, telemetry=telemetry)[0].backward(grad)  # the FP8 baseline keeps BF16
    telemetry.end_step()
    assert telemetry.held_bytes == 0 and telemetry.read().fp4_held_peak_bytes == expected


# --moe-fp4-recompute-experts (docs/design.md §6.6): only the fc1 input is kept; backward recomputes.

def _recomputed_build(model_parallel, device, dispatch: bool, recompute: bool, storage="experts"):
    torch.manual_seed(3)
    options = FP4Options(dispatch=dispatch, experts="fp8", storage=storage, recompute_experts=recompute)
    builder = use_fp8_experts(get_gpt_layer_local_spec(num_experts=EXPERTS), options).submodules.mlp.keywords[
        "submodules"].experts
    config = _config(moe_token_dispatcher_type="alltoall")
    return _spread_weights(builder(EXPERTS, config, pg_collection=model_parallel).to(device))


def _grads(result):
    out, grad_x, grad_p, experts = result
    weights = [p.grad.clone() for p in experts.parameters()]
    return [out, grad_x, grad_p, *weights]


def _bit_equal(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and torch.equal(x, y), f"tensor {i} differs"


def test_recomputed_experts_from_the_payload_keep_only_it_and_give_storage_nones_bits(model_parallel, device):
    """With the MXFP4 dispatch: the payload and the probs are all that is saved; the output is the
    unrecomputed run's and every gradient storage `none`'s (the recompute restores the BF16 SwiGLU input
    and the fc2 FP8 columns, nothing inexact in FP4), bit for bit."""
    payload, probs, grad = _inputs(device)
    received = ref.dequantize_mxfp4(payload)
    recomputed = _recomputed_build(model_parallel, device, dispatch=True, recompute=True)
    with _saved_activations(recomputed) as saved:
        recomputed(received.clone().requires_grad_(True), torch.tensor(COUNTS),
                   probs.clone().requires_grad_(True), payload=payload)
    assert sorted((str(t.dtype), tuple(t.shape)) for t in saved) == sorted(
        [("torch.uint8", tuple(payload.rows.shape)), (str(probs.dtype), tuple(probs.shape))])
    assert saved[0].data_ptr() == payload.rows.data_ptr()  # the received payload itself, no copy
    del saved
    ours = _grads(_run(recomputed, received, probs, grad, payload))
    kept_in_fp4 = _grads(_run(_recomputed_build(model_parallel, device, True, False), received, probs, grad, payload))
    storage_none = _grads(_run(_recomputed_build(model_parallel, device, True, False, storage="none"),
                               received, probs, grad, payload))
    assert torch.equal(ours[0], kept_in_fp4[0])  # forward is unchanged
    _bit_equal(ours, storage_none)
    assert any(not torch.equal(a, b) for a, b in zip(ours[1:], kept_in_fp4[1:])), \
        "the MXFP4-saved SwiGLU / fc2 inputs should round differently than the recomputed ones"


def test_recomputed_fp8_baseline_keeps_the_bf16_tokens_and_gives_its_bits(model_parallel, device):
    """Without a payload (the FP8 baseline): the BF16 tokens and the probs are saved, and every output
    and gradient equals the unrecomputed baseline's, which keeps FP8 columns and the SwiGLU input."""
    payload, probs, grad = _inputs(device)
    received = ref.dequantize_mxfp4(payload)
    recomputed = _recomputed_build(model_parallel, device, dispatch=False, recompute=True)
    x = received.clone().requires_grad_(True)
    with _saved_activations(recomputed) as saved:
        recomputed(x, torch.tensor(COUNTS), probs.clone().requires_grad_(True))
    assert [(str(t.dtype), tuple(t.shape)) for t in saved] == [
        ("torch.bfloat16", tuple(received.shape)), (str(probs.dtype), tuple(probs.shape))]
    del saved
    _bit_equal(_grads(_run(recomputed, received, probs, grad)),
               _grads(_run(_recomputed_build(model_parallel, device, False, False), received, probs, grad)))


def test_recomputed_experts_on_a_rank_without_tokens(model_parallel, device):
    experts = _recomputed_build(model_parallel, device, dispatch=False, recompute=True)
    x = torch.zeros(0, HIDDEN, dtype=torch.bfloat16, device=device, requires_grad=True)
    probs = torch.zeros(0, device=device, requires_grad=True)
    with _saved_activations(experts) as saved:
        out, _ = experts(x, torch.tensor([0] * EXPERTS), probs)
    assert [t.data_ptr() for t in saved] == [probs.data_ptr()]  # the probs only: no tokens to keep
    del saved
    out.sum().backward()
    assert out.shape == (0, HIDDEN) and all(p.grad is not None and not p.grad.any() for p in experts.parameters())


def _megatron_experts(model_parallel, recompute: bool, **overrides):
    from megatron_fp4.integration import use_fp4

    spec = use_fp4(get_gpt_layer_local_spec(num_experts=EXPERTS), FP4Options(recompute_experts=recompute))
    builder = spec.submodules.mlp.keywords["submodules"].experts
    torch.manual_seed(3)
    return builder(EXPERTS, _config(**overrides), pg_collection=model_parallel)


def test_megatrons_experts_recomputed_keep_their_input_and_give_the_same_bits(model_parallel, device, monkeypatch):
    """Megatron's SequentialMLP inside Megatron's checkpoint: it saves its three inputs and nothing
    else, and gives stock SequentialMLP's output and gradients bit for bit; outside training (or
    without grad) it is SequentialMLP's forward."""
    if device.type == "cpu":  # Megatron's checkpoint keeps the CUDA RNG states too: the CPU's stand in
        import megatron.core.tensor_parallel.random as megatron_random

        monkeypatch.setattr(megatron_random, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
        monkeypatch.setattr(megatron_random, "_set_cuda_rng_state", lambda state, *a, **k: None)
    recomputed = _megatron_experts(model_parallel, True).to(device)
    stock = _megatron_experts(model_parallel, False).to(device)
    assert type(recomputed).__name__ == "SequentialMLPRecomputed" and type(stock).__name__ == "SequentialMLP"
    assert recomputed.state_dict().keys() == stock.state_dict().keys()
    payload, probs, grad = _inputs(device)
    received = ref.dequantize_mxfp4(payload)
    counts = torch.tensor(COUNTS)

    def run(experts):
        experts.zero_grad(set_to_none=True)
        x, p = received.clone().requires_grad_(True), probs.clone().requires_grad_(True)
        out, _ = experts(x, counts, p)
        out.backward(grad)
        return [out.detach(), x.grad, p.grad, *(w.grad for w in experts.parameters())]

    _bit_equal(run(recomputed), run(stock))
    x, p = received.clone().requires_grad_(True), probs.clone().requires_grad_(True)
    with _saved_activations(recomputed) as saved:
        recomputed(x, counts, p)
    assert [t.data_ptr() for t in saved] == [x.data_ptr(), counts.data_ptr(), p.data_ptr()]
    del saved
    recomputed.eval()
    with _saved_activations(recomputed) as saved:
        out, _ = recomputed(x, counts, p)
    assert out.grad_fn is not None and len(saved) > 3  # eval: the stock forward, its own saved tensors
    del saved


@pytest.mark.parametrize("overrides, message", [
    (dict(recompute_granularity="selective", recompute_modules=["moe"]), "recompute already"),
    (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1), "recompute already"),
])
def test_recomputed_megatron_experts_refuse_what_would_make_them_a_no_op(model_parallel, overrides, message):
    from megatron_fp4.options import UnsupportedConfiguration

    with pytest.raises(UnsupportedConfiguration, match=message):
        _megatron_experts(model_parallel, True, **overrides)


def test_recomputed_experts_classes_are_made_once_and_pickle():
    import pickle

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec  # noqa: F401
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_fp4.experts.recomputed import experts_recomputed
    from megatron_fp4.integration import use_recomputed_experts

    cls = experts_recomputed(SequentialMLP)
    assert experts_recomputed(cls) is cls and issubclass(cls, SequentialMLP)
    assert pickle.loads(pickle.dumps(cls)) is cls
    # A spec whose experts are a ModuleSpec (as older specs and users' own build them) is rewritten too,
    # and applying the rewrite twice changes nothing more.
    layer = get_gpt_layer_local_spec(num_experts=EXPERTS)
    moe = layer.submodules.mlp.keywords["submodules"]
    moe.experts = ModuleSpec(module=SequentialMLP, submodules=moe.experts.keywords["submodules"])
    options = FP4Options(recompute_experts=True)
    twice = use_recomputed_experts(use_recomputed_experts(layer, options), options)
    assert twice.submodules.mlp.keywords["submodules"].experts.module is cls
    assert moe.experts.module is SequentialMLP  # the original spec untouched
    moe.experts = ModuleSpec(module=("megatron.core.transformer.moe.experts", "SequentialMLP"))
    with pytest.raises(TypeError, match="not a class"):
        use_recomputed_experts(layer, options)
