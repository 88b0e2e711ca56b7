"""TEST SUPPORT ONLY: Megatron's all-to-all dispatcher with and without megatron_fp4's LeanPermute
(dispatch/permute.py) on one rank, in a process of its own (torch.cuda emulated on the CPU where
there is no GPU: Megatron's dispatcher creates CUDA streams). Permute, expert stand-in, combine,
backward; exits non-zero on the first failed check.

    python -m support.lean_permute_checks      # from tests/
"""

import sys


def _config(**extra):
    import torch
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, num_moe_experts=EXPERTS,
                             moe_router_topk=TOPK, moe_ffn_hidden_size=32, moe_token_dispatcher_type="alltoall",
                             add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16,
                             use_cpu_initialization=True, **extra)


EXPERTS, TOPK, TOKENS, HIDDEN = 8, 4, 96, 256
CONFIGS = {"dropless": {}, "dropped and padded": {"moe_expert_capacity_factor": 0.5,
                                                  "moe_pad_expert_input_to_capacity": True}}


STATE = ("hidden_shape", "hidden_shape_before_permute", "routing_map", "reversed_local_input_permutation_mapping",
         "tokens_per_expert", "num_out_tokens")


def _megatrons_dispatch(dispatcher, x, routing_map, probs):
    tokens, permuted_probs = dispatcher.dispatch_preprocess(x, routing_map, probs)
    state = {key: getattr(dispatcher, key) for key in STATE}
    return dispatcher.token_dispatch(tokens, permuted_probs), state


def _quantized_dispatch(dispatcher, x, routing_map, probs):
    """FP4AlltoAllTokenDispatcher's permute of MXFP4 rows, as FP4MoELayer runs it."""
    quantized, permuted_probs = dispatcher.permute_quantized(x, routing_map, probs, quantize=True)
    state = {key: getattr(dispatcher, key) for key in STATE}
    received, permuted_probs = dispatcher.dispatch_fp4(quantized.tokens, permuted_probs, dequantize=True,
                                                       wire=quantized.wire)
    return (received.tokens, permuted_probs), state


def _step(dispatcher, x, routing_map, probs, gy, dispatch=_megatrons_dispatch):
    """Dispatch, scale each row by 3 x its prob (an expert stand-in), combine, backward."""
    x = x.clone().requires_grad_(True)
    probs = probs.clone().requires_grad_(True)
    (tokens, permuted_probs), state = dispatch(dispatcher, x, routing_map, probs)
    tokens, tokens_per_expert, permuted_probs = dispatcher.dispatch_postprocess(tokens, permuted_probs)
    scale = (3 * permuted_probs).unsqueeze(-1).to(tokens.dtype)
    rows = tokens * scale
    out = dispatcher.combine_postprocess(dispatcher.token_combine(dispatcher.combine_preprocess(rows)))
    out.backward(gy)
    return {"out": out.detach(), "rows": rows.detach(), "scale": scale.detach(), "x.grad": x.grad,
            "probs.grad": probs.grad, "tokens_per_expert": tokens_per_expert,
            "indices": dispatcher.reversed_local_input_permutation_mapping, "state": state}


def _bits(t):
    import torch

    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def check(name: str, extra: dict, pg_collection, device) -> None:
    import torch
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from megatron_fp4 import reference as ref
    from megatron_fp4.dispatch.permute import LeanPermute

    class Lean(LeanPermute, MoEAlltoAllTokenDispatcher):
        pass

    config = _config(**extra)
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(TOKENS, 1, HIDDEN, generator=g) * torch.exp2(torch.randint(-8, 8, (TOKENS, 1, HIDDEN),
                                                                              generator=g).float())).bfloat16()
    scores = torch.rand(TOKENS, EXPERTS, generator=g)
    routing_map = torch.zeros(TOKENS, EXPERTS, dtype=torch.bool).scatter_(1, scores.topk(TOPK, dim=1).indices, True)
    probs = scores * routing_map
    gy = torch.randn(TOKENS, 1, HIDDEN, generator=g).bfloat16()
    inputs = [t.to(device) for t in (x, routing_map, probs, gy)]
    stock = _step(MoEAlltoAllTokenDispatcher(EXPERTS, list(range(EXPERTS)), config=config,
                                             pg_collection=pg_collection), *inputs)
    lean_dispatcher = Lean(EXPERTS, list(range(EXPERTS)), config=config, pg_collection=pg_collection)
    lean = _step(lean_dispatcher, *inputs)

    def expect(condition, what):
        if not condition:
            raise SystemExit(f"{name}: {what}")

    expect(lean_dispatcher.one_source_rank(), "one rank must count as one source rank")
    for key in ("rows", "probs.grad", "tokens_per_expert", "indices"):  # gathers and routing: exact
        expect(torch.equal(_bits(lean[key]), _bits(stock[key])), f"{key} differs from Megatron's")
    indices = lean["indices"].cpu()
    expect(indices.numel() < TOKENS * TOPK if extra else indices.numel() == TOKENS * TOPK, "unexpected drops")
    # The sums (the unpermute; the permute's gradient, each copy's gradient being the output gradient
    # gathered back times the stand-in's scale): the reference's, fp32 in position order rounded once;
    # Megatron's (BF16 atomics) within BF16 rounding of each of a token's additions.
    flat_gy = inputs[3].view(TOKENS, HIDDEN)
    for key, terms in (("out", lean["rows"]), ("x.grad", flat_gy[lean["indices"]] * lean["scale"])):
        terms = terms.cpu()
        ours, megatrons = lean[key].view(TOKENS, HIDDEN).cpu(), stock[key].view(TOKENS, HIDDEN).cpu()
        expect(torch.equal(_bits(ours), _bits(ref.sum_rows_by_token(terms, indices, TOKENS))),
               f"{key}: not the reference's sums")
        bound = ref.sum_rows_by_token(terms.float().abs(), indices, TOKENS).float() * TOPK * 2.0**-8
        expect(((ours.float() - megatrons.float()).abs() <= bound).all(), f"{key}: beyond BF16 rounding of Megatron's")
        expect(not torch.equal(ours, torch.zeros_like(ours)), f"{key}: all zeros")
    dropped = torch.ones(TOKENS, dtype=torch.bool)
    dropped[indices] = False
    expect(bool(dropped.any()) == bool(extra), "tokens without copies expected exactly when dropping")
    expect(not lean["x.grad"].view(TOKENS, HIDDEN)[dropped.to(lean["x.grad"].device)].any(),
           "a dropped token must get no gradient")
    check_quantized_permute(name, config, pg_collection, inputs, expect)


def check_quantized_permute(name, config, pg_collection, inputs, expect) -> None:
    """The FP4 dispatcher's permute of MXFP4 rows against its dispatch of Megatron's permuted BF16
    tokens (quantized after the gather): the same dispatcher state, bytes sent, values and gradients."""
    import torch

    from megatron_fp4.dispatch.token_dispatcher import FP4AlltoAllTokenDispatcher

    def dispatcher():
        return FP4AlltoAllTokenDispatcher(EXPERTS, list(range(EXPERTS)), config=config, pg_collection=pg_collection)

    gathered_then_quantized = _step(dispatcher(), *inputs)
    quantized_dispatcher = dispatcher()
    expect(quantized_dispatcher.quantizes_before_permute(), "no fusion, no latent: the quantized permute applies")
    permuted = _step(quantized_dispatcher, *inputs, dispatch=_quantized_dispatch)
    for key, value in gathered_then_quantized["state"].items():
        same = torch.equal(value, permuted["state"][key]) if torch.is_tensor(value) else value == permuted["state"][key]
        expect(same, f"quantized permute: dispatcher state {key} differs")
    for key in ("out", "rows", "x.grad", "probs.grad", "tokens_per_expert", "indices"):
        expect(torch.equal(_bits(permuted[key]), _bits(gathered_then_quantized[key])),
               f"quantized permute: {key} differs from quantizing after the gather")
    expect(permuted["x.grad"].abs().sum() > 0, "quantized permute: no gradient reached the tokens")


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        from support import cuda_on_cpu  # before Megatron, which reads torch.cuda at import

        cuda_on_cpu.install()
    from support.one_rank import one_rank_parallel_state

    device = "cuda"
    with one_rank_parallel_state() as pg_collection:
        for name, extra in CONFIGS.items():
            check(name, extra, pg_collection, device)
            print(f"{name}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
