"""The FP4 dispatch through Megatron's flex dispatcher (DeepEP backend), on two ranks through the
project's DeepEP stand-in (tests/support/deep_ep_standin; tests/distributed/test_flex_fp4_layer.py
runs these under the CPU emulation). The same claims as the all-to-all path's scenarios
(moe_layer_checks.py), against a stock flex MoELayer whose tokens are rounded to MXFP4 by the
reference right before DeepEP's dispatch (straight-through gradient):

- bf16-experts: Megatron's experts behind the FP4 flex dispatcher: output, input gradient and every
  parameter gradient bit for bit; with --moe-fp4-saved-input the same bits again; and the FP4
  dispatch did round (the output differs from the unrounded stock layer).
- fp8-experts: our FP8 experts fed from the received payload: the output bit for bit equal to the same
  experts behind the rounded stock flex dispatcher (which quantize the BF16 tokens themselves),
  gradients within the error of saving SwiGLU and fc2 inputs in MXFP4 (as moe_layer_checks).
- shared-expert / shared-expert-overlap: the same with a shared expert, computed apart or overlapped
  with the dispatch (Megatron's overlap hooks called where its flex dispatcher calls them).
- cache-bf16-experts / cache-fp8-experts / cache-transformer-layer-fp8-experts: --moe-fp4-cache, four
  micro-batches through a checkpointed MoE layer (recompute ["moe"]) or a whole transformer layer
  (["layernorm", "moe"], the public recipe's pair): the same bits with the cache on and off, and the cached recomputes send no MXFP4 dispatch
  (only their probs, through DeepEP's cached mode).
- wire: what crossed DeepEP's dispatch was the MXFP4 payload in its FP8 slot (E4M3 [T, H/2] and
  float32 [T, H/128]), once per forward, and its combine carried BF16 back (forward and backward).
"""

import contextlib

import torch
import torch.distributed as dist

R = 2
HIDDEN, EXPERTS, TOPK, FFN, TOKENS_PER_RANK = 256, 4, 2, 128, 64


def _config(**extra):
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        **extra, num_layers=1, hidden_size=HIDDEN, num_attention_heads=8, num_moe_experts=EXPERTS, moe_router_topk=TOPK,
        moe_ffn_hidden_size=FFN, moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep",
        moe_router_dtype="fp32", moe_aux_loss_coeff=1e-2, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16,
        tensor_model_parallel_size=1, expert_model_parallel_size=R, expert_tensor_parallel_size=1)


def _inputs(rank):
    """Tokens spanning 2^16 in magnitude across blocks (MXFP4's scales matter), and an output gradient."""
    g = torch.Generator(device="cuda").manual_seed(1000 + rank)
    shape = (TOKENS_PER_RANK // 2, 2, HIDDEN)
    scale = torch.exp2(torch.randint(-8, 8, shape, device="cuda", generator=g).float())
    return (torch.randn(shape, device="cuda", generator=g) * scale).bfloat16(), \
        torch.randn(shape, device="cuda", generator=g).bfloat16()


def _rounded_flex_dispatcher(layer, config):
    """Megatron's flex dispatcher whose tokens are rounded to MXFP4 by the reference right before
    DeepEP (inside its DeepEP manager's dispatch: an overlapped shared expert, which the dispatcher
    hands the tokens it was given, still sees them unrounded, as in a stock run)."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher

    from support.moe_layer_checks import _RoundToMXFP4

    old = layer.token_dispatcher
    dispatcher = MoEFlexTokenDispatcher(old.num_local_experts, old.local_expert_indices, config=config,
                                        pg_collection=get_default_pg_collection())
    manager = dispatcher._comm_manager
    send = manager.dispatch
    manager.dispatch = lambda hidden_states, *args, **kwargs: send(_RoundToMXFP4.apply(hidden_states, "ceil"),
                                                                   *args, **kwargs)
    return dispatcher


def _run(layer, x, gy):
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    out.backward(gy)
    return out.detach(), x.grad, {name: p.grad for name, p in layer.named_parameters()}


def _relative(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@contextlib.contextmanager
def _parallel_state():
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(expert_model_parallel_size=R, expert_tensor_parallel_size=1)
    try:
        model_parallel_cuda_manual_seed(1234)
        yield
    finally:
        parallel_state.destroy_model_parallel()


def _check_bf16_experts(rank, shared=False, overlap=False):
    from megatron_fp4.dispatch.flex import FP4FlexTokenDispatcher
    from megatron_fp4.integration.standalone import build_moe_layer
    from megatron_fp4.options import FP4Options
    from support.moe_layer_checks import assert_fp4_equals_rounded

    with _parallel_state():
        config = _config(**({"moe_shared_expert_intermediate_size": FFN, "moe_shared_expert_overlap": overlap}
                            if shared else {}))
        fp4 = build_moe_layer(config, FP4Options(dispatch=True)).cuda()
        fp4_saved = build_moe_layer(config, FP4Options(dispatch=True, saved_input=True)).cuda()
        stock = build_moe_layer(config).cuda()
        rounded = build_moe_layer(config).cuda()
        assert isinstance(fp4.token_dispatcher, FP4FlexTokenDispatcher), type(fp4.token_dispatcher)
        for layer in (fp4_saved, stock, rounded):
            layer.load_state_dict(fp4.state_dict())
        rounded.token_dispatcher = _rounded_flex_dispatcher(rounded, config)
        if overlap:
            rounded.token_dispatcher.set_shared_experts(rounded.shared_experts)
        assert (fp4.shared_experts is not None) == shared
        x, gy = _inputs(rank)
        where = f"rank {rank} flex, BF16 experts, shared expert {shared}, overlap {overlap}"
        assert_fp4_equals_rounded(where, fp4, fp4_saved, rounded, stock, x, gy)

def _check_fp8_experts(rank):
    from megatron_fp4.experts import FP8Experts
    from megatron_fp4.integration.standalone import build_moe_layer
    from megatron_fp4.options import FP4Options

    with _parallel_state():
        config = _config()
        ours = build_moe_layer(config, FP4Options(dispatch=True, experts="fp8")).cuda()
        assert isinstance(ours.experts, FP8Experts)
        # The same FP8 experts (a second instance, same weights) behind Megatron's flex dispatcher
        # rounding the tokens: they quantize the BF16 tokens themselves.
        rounded = build_moe_layer(config).cuda()
        rounded.experts = build_moe_layer(config, FP4Options(dispatch=True, experts="fp8")).cuda().experts
        rounded.load_state_dict(ours.state_dict())
        rounded.token_dispatcher = _rounded_flex_dispatcher(rounded, config)
        bf16 = build_moe_layer(config).cuda()
        bf16.load_state_dict(ours.state_dict())
        bf16.token_dispatcher = _rounded_flex_dispatcher(bf16, config)
        x, gy = _inputs(rank)
        out, dx, grads = _run(ours, x, gy)
        errors = {}
        for name, layer in (("fp8 experts, rounded", rounded), ("bf16 experts, rounded", bf16)):
            out_r, dx_r, grads_r = _run(layer, x, gy)
            errors[name] = {"output": _relative(out, out_r), "input grad": _relative(dx, dx_r)}
            errors[name].update({k: _relative(grads[k], g) for k, g in grads_r.items() if "experts" in k})
        print(f"rank {rank} flex FP8 experts, relative differences:",
              {n: {k: f"{v:.1e}" for k, v in e.items()} for n, e in errors.items()}, flush=True)
        same, bf16_errors = errors["fp8 experts, rounded"], errors["bf16 experts, rounded"]
        assert same["output"] == 0.0, f"rank {rank}: flex FP8 experts output differs from the same experts on rounded tokens"
        assert max(same.values()) < 0.25, f"rank {rank}: flex FP8 experts gradients far from the BF16-saving baseline"
        assert bf16_errors["output"] < 0.06, f"rank {rank}: flex FP8 experts output beyond FP8 error of Megatron's"
        assert max(bf16_errors.values()) < 0.25, f"rank {rank}: flex FP8 experts gradients far from Megatron's"


def _check_wire(rank):
    """What DeepEP's Buffer was handed: dispatch x as (E4M3 [T, H/2], float32 [T, H/128]) forward, BF16
    [R, H] to combine (the dispatch's backward, and the combine's forward), BF16 to the combine's
    backward (a cached dispatch)."""
    import deep_ep

    from megatron_fp4.integration.standalone import build_moe_layer
    from megatron_fp4.options import FP4Options

    seen = []
    real_dispatch, real_combine = deep_ep.Buffer.dispatch, deep_ep.Buffer.combine

    def describe(x):
        parts = x if isinstance(x, tuple) else (x,)
        return tuple((p.dtype, p.shape[1]) for p in parts)

    def dispatch(self, x, *args, **kwargs):
        seen.append(("dispatch", describe(x), kwargs.get("handle", args[0] if args else None) is not None))
        return real_dispatch(self, x, *args, **kwargs)

    def combine(self, x, *args, **kwargs):
        seen.append(("combine", describe(x)))
        return real_combine(self, x, *args, **kwargs)

    deep_ep.Buffer.dispatch, deep_ep.Buffer.combine = dispatch, combine
    try:
        with _parallel_state():
            layer = build_moe_layer(_config(), FP4Options(dispatch=True)).cuda()
            x, gy = _inputs(rank)
            _run(layer, x, gy)
    finally:
        deep_ep.Buffer.dispatch, deep_ep.Buffer.combine = real_dispatch, real_combine
    mxfp4 = ((torch.float8_e4m3fn, HIDDEN // 2), (torch.float32, HIDDEN // 128))
    bf16 = ((torch.bfloat16, HIDDEN),)
    # forward: dispatch (MXFP4), combine (BF16); backward: the combine's (a cached BF16 dispatch),
    # then the dispatch's (a BF16 combine of the gradient)
    expected = [("dispatch", mxfp4, False), ("combine", bf16), ("dispatch", bf16, True), ("combine", bf16)]
    assert seen == expected, f"rank {rank}: DeepEP was handed {seen}"


def _check_cache(rank, experts, whole_layer=False):
    """--moe-fp4-cache through flex: a layer checkpointed with recompute_modules ["moe"], four
    micro-batches in flight, gives the same outputs and gradients bit for bit with the cache on and
    off, and with it on the recomputes send no MXFP4 dispatch through DeepEP (counted)."""
    import deep_ep

    from support.moe_layer_checks import (MICRO_BATCHES, _checkpointed_steps, _layernorm_recompute_without_transformer_engine,
                                          assert_cache_changes_no_bits, cache_pair, cache_recompute_modules)

    modules = cache_recompute_modules(whole_layer)

    sends = []  # torch.uint8 for each MXFP4 dispatch DeepEP is handed, as _checkpointed_steps counts
    real_dispatch = deep_ep.Buffer.dispatch

    def dispatch(self, x, *args, **kwargs):
        sends.append(torch.uint8 if isinstance(x, tuple) else x.dtype)
        return real_dispatch(self, x, *args, **kwargs)

    deep_ep.Buffer.dispatch = dispatch
    try:
        with _parallel_state(), _layernorm_recompute_without_transformer_engine():
            config = _config(recompute_granularity="selective", recompute_modules=modules, hidden_dropout=0.0,
                             attention_dropout=0.0)
            uncached, cached, moe = cache_pair(config, experts, whole_layer)
            pairs = [_inputs(10 * rank + m) for m in range(MICRO_BATCHES)]
            inputs, grads = [p[0] for p in pairs], [p[1] for p in pairs]
            uncached_run = _checkpointed_steps(uncached, inputs, grads, sends)
            cached_run = _checkpointed_steps(cached, inputs, grads, sends)
    finally:
        deep_ep.Buffer.dispatch = real_dispatch
    where = f"rank {rank} flex cache, recompute {modules}, {experts} experts"
    assert_cache_changes_no_bits(where, uncached_run, cached_run, moe.recompute_cache)


SCENARIOS = {"bf16-experts": _check_bf16_experts, "fp8-experts": _check_fp8_experts, "wire": _check_wire,
             "shared-expert": lambda rank: _check_bf16_experts(rank, shared=True),
             "shared-expert-overlap": lambda rank: _check_bf16_experts(rank, shared=True, overlap=True),
             "cache-bf16-experts": lambda rank: _check_cache(rank, "bf16"),
             "cache-fp8-experts": lambda rank: _check_cache(rank, "fp8"),
             "cache-transformer-layer-fp8-experts": lambda rank: _check_cache(rank, "fp8", whole_layer=True)}


def run_scenarios(rank: int, scratch: str, names, results: str) -> None:
    """tests/support/two_ranks.py's entry point: the stand-in installed, then each named scenario;
    this rank writes results/<name>.rank<R>.txt, "ok" or the failed assertion."""
    from support import deep_ep_on_cpu
    from support.moe_layer_checks import run_each_reporting

    deep_ep_on_cpu.install()
    run_each_reporting(SCENARIOS, names, rank, results)
