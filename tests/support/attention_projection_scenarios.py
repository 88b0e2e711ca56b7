"""The FP8 output projection of an MLA layer under Megatron's mla_up_proj and core_attn recompute
(tests/distributed/test_attention_projection_recompute.py), run by the two ranks of
run_on_two_ranks, one storage each (Megatron's recompute asks for CUDA RNG states: on the CPU
torch.cuda is emulated). MLA self-attention from the swapped local spec with the fused attention
and FP8 linears: under mla_up_proj recompute the fused attention still saves its output, and the
output projection keeps it by reference; under core_attn recompute the attention's first pass runs
without grad, saves nothing, and the projection keeps its own copy. The layer's results equal those
of the same layer whose projection always keeps its own copy: bit for bit with FP8-saved inputs;
with MXFP4-saved inputs all but the projection's weight gradient where it keeps the reference
(then from the BF16 output instead of an MXFP4 copy). q/k and v heads have one size here, so that
the CPU's flash kernel serves them. q LoRA as DeepSeek-V3's: every projection is FP8."""

import contextlib

import torch
import torch.nn.functional as F

TOKENS, BATCH, HIDDEN, HEADS = 32, 2, 128, 8


def _mla_attention(storage: str, recompute_modules):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron_fp4.integration import FP4Options, use_fp4

    config = MLATransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, q_lora_rank=128, kv_lora_rank=128,
        qk_head_dim=32, qk_pos_emb_head_dim=16, v_head_dim=48, rope_type="yarn", rotary_scaling_factor=40, mscale=1.0,
        mscale_all_dim=1.0, attention_dropout=0.0, hidden_dropout=0.0, add_bias_linear=False, bf16=True,
        params_dtype=torch.bfloat16, gradient_accumulation_fusion=False, use_cpu_initialization=True,
        masked_softmax_fusion=False, recompute_granularity="selective", recompute_modules=recompute_modules,
        # MoE settings the FP8 experts' flags ask for (this layer has none of its own).
        num_moe_experts=4, moe_ffn_hidden_size=128, moe_token_dispatcher_type="alltoall", gated_linear_unit=True,
        activation_func=F.silu)
    options = FP4Options(dispatch=storage == "all", experts="fp8", linears="fp8", storage=storage,
                         fused_attention=True)
    spec = use_fp4(get_gpt_layer_local_spec(multi_latent_attention=True), options).submodules.self_attention
    torch.manual_seed(7)
    return MLASelfAttention(config, spec.submodules, layer_number=1, attn_mask_type=AttnMaskType.causal,
                            pg_collection=get_default_pg_collection()).to(torch.bfloat16)


@contextlib.contextmanager
def _never_by_reference():
    """The projection as before: its own copy whatever the fused attention saves."""
    from megatron_fp4.linears import module

    rule = module.saved_by_its_producer
    module.saved_by_its_producer = lambda x: False
    try:
        yield
    finally:
        module.saved_by_its_producer = rule


def _forward_backward(layer, hidden, grad):
    """The output and gradients, and how the output projection kept its input."""
    layer.zero_grad(set_to_none=True)
    x = hidden.clone().requires_grad_(True)
    out, _ = layer(x, attention_mask=None)
    kept = out.grad_fn.call.saved  # the output projection's node: its LinearCall
    out.backward(grad)
    return {"output": out.detach(), "input grad": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}, kept


def run(rank: int, scratch: str) -> None:
    from megatron_fp4.linears import SavedInput

    from support.recompute_ranks import recompute_on_this_rank

    with recompute_on_this_rank(rank, (TOKENS, BATCH, HIDDEN)) as (hidden, grad):
        storage, own_copy = (("experts", SavedInput.FP8), ("all", SavedInput.MXFP4))[rank]
        for modules, by_reference in ((["mla_up_proj"], True), (["core_attn"], False)):
            layer = _mla_attention(storage, modules)
            assert layer.recompute_up_proj == ("mla_up_proj" in modules)
            found, kept = _forward_backward(layer, hidden, grad)
            with _never_by_reference():
                expected, kept_before = _forward_backward(layer, hidden, grad)
            assert (kept, kept_before) == (SavedInput.ORIGINAL if by_reference else own_copy, own_copy), (
                storage, modules, kept, kept_before)
            differing = [name for name in expected if not torch.equal(expected[name], found[name])]
            exact_now = ["linear_proj.weight"] if by_reference and storage == "all" else []
            assert differing == exact_now, f"storage {storage}, recompute {modules}: differ: {differing}"
