"""Megatron's SequentialMLP experts (CPU, one gloo rank) with their saved fc1 inputs kept as MXFP4
payload rows: outputs and every gradient bit-identical to keeping BF16, and exactly the experts'
input slices go to FP4."""

import contextlib
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

from megatron_fp4 import reference as ref
from megatron_fp4.dispatch.saved_fp4 import FP4SavedRows

HIDDEN, EXPERTS = 256, 4

# The experts are built on the CPU, and the saved rows' dequantization runs under Triton's CPU
# interpreter, which a CUDA machine does not enable (tests/conftest.py); the kernels refuse CPU tensors
# without it. On GPUs the saved rows run in the two-rank MoE layer scenarios (--moe-fp4-saved-input).
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU only: Megatron's experts built on the CPU")


@pytest.fixture
def experts():
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    try:
        config = TransformerConfig(
            num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, num_moe_experts=EXPERTS, moe_router_topk=2,
            moe_ffn_hidden_size=128, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
            use_cpu_initialization=True, bf16=True, params_dtype=torch.bfloat16, gradient_accumulation_fusion=False,
        )
        builder = get_gpt_layer_local_spec(num_experts=EXPERTS).submodules.mlp.keywords["submodules"].experts
        torch.manual_seed(3)
        yield builder(EXPERTS, config, pg_collection=get_default_pg_collection())
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def _step(experts, received, tokens_per_expert, probs, grad, payload=None):
    """One forward + backward; with a payload, the experts' input (x, whose slices fc1 saves) is
    kept as FP4 while backward waits."""
    experts.zero_grad(set_to_none=True)
    x = received.clone().requires_grad_(True)
    saved = FP4SavedRows(x, payload) if payload is not None else contextlib.nullcontext()
    with saved:
        out, _ = experts(x, tokens_per_expert, probs)
    out.backward(grad)
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in experts.named_parameters()}, saved


def test_fc1_inputs_saved_as_fp4_give_the_same_bits(experts):
    g = torch.Generator().manual_seed(7)
    tokens_per_expert = torch.tensor([5, 0, 10, 5])
    tokens = int(tokens_per_expert.sum())
    raw = torch.randn(tokens, HIDDEN, generator=g) * torch.exp2(torch.randint(-6, 6, (tokens, HIDDEN), generator=g).float())
    payload = ref.quantize_mxfp4(raw.bfloat16())
    received = ref.dequantize_mxfp4(payload)  # what the dispatch hands the experts
    probs = torch.rand(tokens, generator=g)
    grad = torch.randn(tokens, HIDDEN, generator=g).bfloat16()

    plain = _step(experts, received, tokens_per_expert, probs, grad)
    in_fp4 = _step(experts, received, tokens_per_expert, probs, grad, payload)

    assert in_fp4[3].replaced == 3  # one fc1 input slice per non-empty expert, nothing else
    assert torch.equal(in_fp4[0].view(torch.int16), plain[0].view(torch.int16))
    assert torch.equal(in_fp4[1].view(torch.int16), plain[1].view(torch.int16))
    for name, g_plain in plain[2].items():
        assert torch.equal(in_fp4[2][name].view(torch.int16), g_plain.view(torch.int16)), name


def test_refuses_a_source_that_does_not_match_the_payload():
    payload = ref.quantize_mxfp4(torch.randn(6, HIDDEN).bfloat16())
    with pytest.raises(ValueError, match="matching"):
        FP4SavedRows(torch.zeros(5, HIDDEN, dtype=torch.bfloat16), payload)


def test_the_bf16_source_is_not_kept_alive_until_backward(experts):
    """Autograd keeps the pack hook with every tensor it packed; the hook must not keep the BF16
    experts' input alive beside the FP4 rows saved in its place."""
    g = torch.Generator().manual_seed(8)
    tokens_per_expert = torch.tensor([6, 2, 0, 8])
    payload = ref.quantize_mxfp4(torch.randn(16, HIDDEN, generator=g).bfloat16())
    leaf = ref.dequantize_mxfp4(payload).requires_grad_(True)
    source = leaf * 1  # not a leaf, like the dispatch's output: only saved tensors could keep it
    alive = weakref.ref(source)
    with FP4SavedRows(source, payload) as saved:
        out, _ = experts(source, tokens_per_expert, torch.rand(16, generator=g))
    del source
    gc.collect()
    assert saved.replaced == 3 and alive() is None, "the BF16 source outlives the forward"
    out.sum().backward()
    assert leaf.grad is not None


def test_telemetry_counts_the_fp4_rows_until_backward_reads_them(experts):
    from megatron_fp4.formats import mxfp4_wire_bytes_per_row
    from megatron_fp4.telemetry import Telemetry

    g = torch.Generator().manual_seed(9)
    tokens_per_expert = torch.tensor([6, 2, 0, 8])
    payload = ref.quantize_mxfp4(torch.randn(16, HIDDEN, generator=g).bfloat16())
    x = ref.dequantize_mxfp4(payload).requires_grad_(True)
    telemetry = Telemetry()
    with FP4SavedRows(x, payload, telemetry):
        out, _ = experts(x, tokens_per_expert, torch.rand(16, generator=g))
    assert telemetry.held_bytes == 16 * mxfp4_wire_bytes_per_row(HIDDEN)  # every row, in the slices of 3 experts
    out.sum().backward()
    assert telemetry.held_bytes == 0
