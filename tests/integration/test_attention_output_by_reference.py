"""The FP8 attention output projection keeps the fused attention's output by reference where the
SDPA kernel saves that output itself (linears.module.saved_by_its_producer), and its own FP8 /
MXFP4 copy wherever keeping the tensor would hold memory the kernel does not: gradients, what the
graph saves, the cases that keep the copy. On the CPU torch's flash kernel serves one head
dimension for q, k and v and saves its output as the CUDA kernels do; MLA's two head dimensions
go to the math kernel there, which saves no output. On a GPU the last test checks each CUDA kernel."""

import contextlib
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron_fp4.attention import FusedCoreAttention
from megatron_fp4.linears import FP8RowParallelLinear, LinearRole, SavedInput, saved_by_its_producer
from megatron_fp4.options import FP4Options, UnsupportedConfiguration

from support.saved_tensors import saved_storages

HIDDEN, HEADS, V_DIM, TOKENS = 256, 4, 64, 48
ONE_RANK = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))
FP8_SAVED = FP4Options(experts="fp8", linears="fp8")
MXFP4_SAVED = FP4Options(dispatch=True, experts="fp8", linears="fp8", storage="all")


def _config():
    return TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, kv_channels=V_DIM, num_moe_experts=4,
        moe_ffn_hidden_size=128, moe_token_dispatcher_type="alltoall", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, use_cpu_initialization=True, bf16=True, params_dtype=torch.bfloat16,
        gradient_accumulation_fusion=False, attention_dropout=0.0, hidden_dropout=0.0)


def _attention(qk_dim=V_DIM):
    return FusedCoreAttention(_config(), 1, AttnMaskType.causal, "self", pg_collection=ONE_RANK, k_channels=qk_dim,
                              v_channels=V_DIM)


def _projection(model_parallel, options, device):
    """The attention's linear_proj as Megatron builds it (attention.py), with fixed weights."""
    config = _config()
    torch.manual_seed(3)
    layer = FP8RowParallelLinear(HEADS * V_DIM, HIDDEN, config=config, options=options, role=LinearRole.ATTENTION,
                                 init_method=config.output_layer_init_method, bias=False, input_is_parallel=True,
                                 skip_bias_add=True, is_expert=False, tp_group=model_parallel.tp)
    return layer.to(device)


def _qkv(device, b=1, qk_dim=V_DIM, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(TOKENS, b, HEADS, qk_dim), (TOKENS, b, HEADS, qk_dim), (TOKENS, b, HEADS, V_DIM)]
    return [torch.randn(*shape, generator=g).bfloat16().to(device).requires_grad_(True) for shape in shapes]


def _kept_by_projection(output: torch.Tensor):
    """The tensors the projection's backward node keeps of its input (the weight comes first)."""
    return list(output.grad_fn.saved_tensors[1:])


def _forward_backward(attention, projection, qkv, between=lambda t: t, around_projection=contextlib.nullcontext):
    """The projection's output, what its node saves besides the weight, the storages the projection
    adds to the graph's, and the gradients; `between` stands for what Megatron does between the two."""
    out = between(attention(*qkv, None))
    with around_projection():
        y, _ = projection(out)
    kept = _kept_by_projection(y)
    added = saved_storages(y).keys() - saved_storages(out).keys() - {projection.weight.untyped_storage().data_ptr()}
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y)
    y.backward(grad)
    grads = [t.grad for t in qkv] + [projection.weight.grad]
    for t in (*qkv, projection.weight):
        t.grad = None
    return SimpleNamespace(output=y.detach(), kept=kept, added=added, grads=grads)


def _sdpa_saved_output(out: torch.Tensor) -> torch.Tensor:
    return out._base.grad_fn._raw_saved_output.data


def _is_fp8_copy(kept) -> bool:
    return {t.dtype for t in kept} == {torch.float8_e4m3fn, torch.float32, torch.int64}


@pytest.mark.parametrize("b", [1, 2])
def test_the_projection_keeps_the_saved_attention_output_and_computes_the_same(model_parallel, device, b):
    """Kept by reference: the projection's node saves the attention output itself, a view of what
    SDPA saved (no storage the attention's graph does not hold already), and every gradient equals
    the FP8-saved path's (fed a copy of the same output) bit for bit."""
    attention, projection, qkv = _attention(), _projection(model_parallel, FP8_SAVED, device), _qkv(device, b)
    out = attention(*qkv, None)
    assert saved_by_its_producer(out)
    assert out.untyped_storage().data_ptr() == _sdpa_saved_output(out).untyped_storage().data_ptr()
    by_reference = _forward_backward(attention, projection, qkv)
    copied = _forward_backward(attention, projection, qkv, between=torch.clone)
    [kept] = by_reference.kept
    assert kept.dtype == torch.bfloat16 and kept.shape == (TOKENS, b, HEADS * V_DIM)
    assert by_reference.added == set(), "the projection holds a storage of its own"
    assert _is_fp8_copy(copied.kept) and copied.added  # the FP8 columns, their scales, the segment offsets
    assert torch.equal(by_reference.output, copied.output)
    for name, ours, theirs in zip(("q", "k", "v", "weight"), by_reference.grads, copied.grads):
        assert torch.equal(ours, theirs), name


def test_under_storage_all_the_weight_gradient_comes_from_the_exact_input(model_parallel, device):
    """Under --moe-fp4-storage all the projection's weight gradient comes from the BF16 output
    itself, as with FP8-saved inputs, not from an MXFP4 copy."""
    qkv = _qkv(device)
    mxfp4 = _forward_backward(_attention(), _projection(model_parallel, MXFP4_SAVED, device), qkv)
    fp8 = _forward_backward(_attention(), _projection(model_parallel, FP8_SAVED, device), qkv)
    copied = _forward_backward(_attention(), _projection(model_parallel, MXFP4_SAVED, device), qkv,
                               between=torch.clone)
    assert [t.dtype for t in copied.kept] == [torch.uint8]  # the MXFP4 copy where the output is not saved
    assert mxfp4.added == set() and torch.equal(mxfp4.grads[-1], fp8.grads[-1])
    assert not torch.equal(mxfp4.grads[-1], copied.grads[-1])


def _offloaded(pack_from):
    """Saved-tensor hooks that keep a host copy of what is saved, as activation offloading does."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach().cpu().clone(), lambda t: t.to(pack_from))


@pytest.mark.parametrize("case", ["math kernel (MLA heads)", "core_attn recompute", "offloaded attention",
                                  "hooks on the projection"])
def test_the_projection_keeps_its_own_copy_where_the_output_is_not_saved(model_parallel, device, case):
    """Where keeping the attention output would hold memory the attention does not (the math kernel
    saves no output and copies in the reshape; a recomputed attention's output is freed after
    forward; an offloaded one leaves the GPU), or where hooks take what the projection saves, it
    keeps its FP8 copy, as without the fused attention."""
    if device.type == "cuda" and case.startswith("math"):
        pytest.skip("the math kernel serves the CPU only")
    qk_dim = 96 if case.startswith("math") else V_DIM
    attention, projection, qkv = _attention(qk_dim), _projection(model_parallel, FP8_SAVED, device), _qkv(
        device, qk_dim=qk_dim)
    run = lambda **kwargs: _forward_backward(attention, projection, qkv, **kwargs)  # noqa: E731
    if case == "core_attn recompute":  # Megatron's checkpoint is reentrant too: attention runs without grad
        result = run(between=lambda _: torch.utils.checkpoint.checkpoint(attention, *qkv, None, use_reentrant=True))
    elif case == "offloaded attention":
        with _offloaded(device):
            out = attention(*qkv, None)
        assert not saved_by_its_producer(out)
        result = run(between=lambda _: out)
    elif case == "hooks on the projection":
        result = run(around_projection=lambda: _offloaded(device))
    else:
        assert not saved_by_its_producer(attention(*qkv, None))
        result = run()
    assert _is_fp8_copy(result.kept), [(t.dtype, tuple(t.shape)) for t in result.kept]


def test_a_tensor_of_another_storage_is_not_taken_for_the_saved_output():
    """Evidence is the storage: views of the saved output count, a copy or another op's output not."""
    q = torch.randn(1, 2, 16, 32, requires_grad=True)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # on the CPU too: it saves its output
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert saved_by_its_producer(out) and saved_by_its_producer(out.transpose(1, 2)[:, 3:])
    assert not saved_by_its_producer(out.clone()) and not saved_by_its_producer(out * 2)
    assert not saved_by_its_producer(q) and not saved_by_its_producer(q.exp())  # exp saves its result, not "output"


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["separate", "split from one projection"])
@pytest.mark.parametrize("b", [1, 2])
@pytest.mark.parametrize("qk_dim", [128, 192], ids=["standard", "mla"])
def test_fused_kernels_save_the_output_the_projection_reads(model_parallel, monkeypatch, qk_dim, b, layout):
    """On each CUDA kernel that serves the shape (flash, memory-efficient, cuDNN), what the fused
    attention hands the projection is a view of the output the kernel saves, for one sequence per
    micro-batch and more, q/k/v laid out as Megatron's projections give them: the projection then
    adds no memory of its own (measured by the allocator, besides its output and a few bytes)."""
    import megatron_fp4.attention as attention_module

    s, heads, v_dim = 512, 16, 128
    device = torch.device("cuda")
    config = _config()
    config.num_attention_heads = heads
    projection = FP8RowParallelLinear(heads * v_dim, HIDDEN, config=config,
                                      options=FP4Options(experts="fp8", linears="fp8", weights_per_use=True),
                                      role=LinearRole.ATTENTION, init_method=config.output_layer_init_method,
                                      bias=False, input_is_parallel=True, skip_bias_add=True, is_expert=False,
                                      tp_group=model_parallel.tp).to(device)
    attention = FusedCoreAttention(config, 1, AttnMaskType.causal, "self", pg_collection=ONE_RANK, k_channels=qk_dim,
                                   v_channels=v_dim)
    dims = (qk_dim, qk_dim, v_dim)
    if layout == "separate":
        qkv = [torch.randn(s, b, heads, d, device=device, dtype=torch.bfloat16, requires_grad=True) for d in dims]
    else:
        fused = torch.randn(s, b, heads, sum(dims), device=device, dtype=torch.bfloat16, requires_grad=True)
        qkv = fused.split(dims, dim=-1)
    with torch.no_grad():  # the GEMMs' first call allocates what they keep (workspaces)
        projection(torch.zeros(s, b, heads * v_dim, device=device, dtype=torch.bfloat16))
    served = []
    for backend in attention_module.FUSED_BACKENDS:
        monkeypatch.setattr(attention_module, "FUSED_BACKENDS", (backend,))
        try:
            out = attention(*qkv, None)
        except UnsupportedConfiguration:
            continue
        served.append(backend.name)
        assert saved_by_its_producer(out), backend.name
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y, _ = projection(out)
        torch.cuda.synchronize()
        added = torch.cuda.memory_allocated() - before
        own_copy = out.numel()  # what an FP8 copy would take, scales aside
        assert added - y.numel() * y.element_size() < 2 ** 16 < own_copy, (backend.name, added)
        y.sum().backward()
        del out, y
    print(f"q/k {qk_dim}, v {v_dim}, b {b}, {layout}: served by {served}")
    assert served


def test_the_private_hook_query_exists_on_this_torch():
    """Without it every projection keeps its own copy (safe, but the saving is lost): fail loudly."""
    from megatron_fp4.linears import module

    assert module._top_saved_tensor_hooks is not None and not module._saved_tensor_hooks_active()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert module._saved_tensor_hooks_active()
