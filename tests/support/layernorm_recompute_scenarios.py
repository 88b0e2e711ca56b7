"""The FP8 linears under Megatron's layernorm recompute (tests/distributed/test_layernorm_recompute.py),
run by the two ranks of run_on_two_ranks, one storage each (Megatron's recompute asks for CUDA RNG
states: on the CPU torch.cuda is emulated). A dense transformer layer of the whole FP4 recipe with
--recompute-modules layernorm: the layers reading a layernorm's output keep it by reference. With
FP8-saved inputs the output and every gradient equal those of the same layer without the recompute,
bit for bit (the recompute refills the same values, which backward quantizes as forward would
have). With every saved input in MXFP4 everything but those readers' weight gradients does: theirs
now come from the BF16 input instead of its MXFP4 copy."""

import torch
import torch.nn.functional as F

HIDDEN, TOKENS, BATCH = 256, 48, 2


def _dense_layer(storage: str, recompute_modules):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from megatron_fp4.integration import FP4Options, use_fp4

    recompute = dict(recompute_granularity="selective", recompute_modules=recompute_modules) if recompute_modules else {}
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=384, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16, hidden_dropout=0.0,
        attention_dropout=0.0, gradient_accumulation_fusion=False, use_cpu_initialization=True,
        # The dense layer of an MoE model (DeepSeek-V3's first layers): the recipe's flags need one.
        num_moe_experts=4, moe_ffn_hidden_size=128, moe_token_dispatcher_type="alltoall", **recompute)
    spec = use_fp4(get_gpt_layer_local_spec(), FP4Options(dispatch=True, experts="fp8", linears="fp8", storage=storage))
    torch.manual_seed(7)
    return TransformerLayer(config, spec.submodules, layer_number=1,
                            pg_collection=get_default_pg_collection()).to(torch.bfloat16)


def _forward_backward(layer, hidden, grad):
    """The output and gradients, and how many tensors saved for backward had no storage between
    forward and backward (emptied by Megatron's layernorm recompute, refilled before their use)."""
    x = hidden.clone().requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out, _ = layer(x, attention_mask=None)
    emptied = sum(1 for t in saved if t.untyped_storage().nbytes() == 0)
    out.backward(grad)
    results = {"output": out.detach(), "input grad": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}
    return results, emptied


def run(rank: int, scratch: str) -> None:
    from megatron_fp4.linears import SavedInput

    from support.recompute_ranks import recompute_on_this_rank

    with recompute_on_this_rank(rank, (TOKENS, BATCH, HIDDEN)) as (hidden, grad):
        # One storage per rank, so that the two cases run side by side.
        storage, inexact_saved, differing_expected = (
            ("experts", SavedInput.FP8, []),
            ("all", SavedInput.MXFP4, ["self_attention.linear_qkv.weight", "mlp.linear_fc1.weight"]))[rank]
        plain, recomputed = _dense_layer(storage, None), _dense_layer(storage, ["layernorm"])
        assert recomputed.recompute_input_layernorm and recomputed.recompute_pre_mlp_layernorm
        saved = {name: m.fp8.saved for name, m in recomputed.named_modules() if hasattr(m, "fp8")}
        assert saved == {"self_attention.linear_qkv": SavedInput.ORIGINAL, "self_attention.linear_proj": inexact_saved,
                         "mlp.linear_fc1": SavedInput.ORIGINAL, "mlp.linear_fc2": inexact_saved}, saved
        (expected, emptied_plain), (found, emptied) = (_forward_backward(plain, hidden, grad),
                                                       _forward_backward(recomputed, hidden, grad))
        # The two layernorm outputs, kept by qkv and fc1 and nobody else: stored nowhere in between.
        assert (emptied_plain, emptied) == (0, 2), (storage, emptied_plain, emptied)
        differing = [name for name in expected if not torch.equal(expected[name], found[name])]
        assert differing == differing_expected, f"storage {storage}: differ under layernorm recompute: {differing}"
