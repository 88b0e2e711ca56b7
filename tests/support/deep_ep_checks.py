"""The DeepEP stand-in's scenarios (tests/support/deep_ep_standin; tests/distributed/
test_deep_ep_standin.py runs them), each a function of the rank run by both ranks of a two-rank
group under the CPU emulation (gloo, torch.cuda emulated):

- buffer: the Buffer API directly. Layout, dispatch (row order, relative top-k indices, zeroed
  weights, per-expert counts with and without alignment, num_worst_tokens padding), combine
  (every token back as x times the ranks it went to, exact for small integers; the weights
  summed), cached dispatch, the (FP8, scales) form byte for byte, a rank that sends nothing, the
  async arguments Megatron passes, and the refusals.
- moe-layer: Megatron's own MoELayer with the flex dispatcher and its DeepEP backend, through the
  stand-in, against a stock alltoall MoELayer with the same weights: outputs, input gradients and
  parameter gradients within 1e-2 relative (the two sum in different orders)."""

import torch
import torch.distributed as dist

R = 2  # ranks


def _install():
    from support import deep_ep_on_cpu

    deep_ep_on_cpu.install()


# ------------------------------------------------------------------------------------------ buffer

T, K, E, H = 12, 3, 6, 256  # tokens per rank, top-k, experts (3 per rank), hidden
UNUSED_EXPERT = 5  # no token picks it


def _routing(source: int):
    """Rank `source`'s top-k (distinct experts, some -1), weights and integer-valued BF16 tokens;
    every rank can rebuild every other rank's."""
    g = torch.Generator().manual_seed(10 + source)
    idx = torch.stack([torch.randperm(UNUSED_EXPERT, generator=g)[:K] for _ in range(T)])
    idx[torch.rand(T, K, generator=g) < 0.25] = -1
    local = range(source * E // R, (source + 1) * E // R)
    idx[0] = -1  # sent nowhere
    idx[1] = torch.tensor([local[0], -1, local[1]])  # only this rank's experts
    idx[2] = torch.tensor([-1, (local[0] + E // R) % E, -1])  # only the other rank's
    weights = torch.rand(T, K, generator=g)
    x = torch.randint(-8, 9, (T, H), generator=g).bfloat16()
    return idx.contiguous(), weights, x


def _fp8(source: int):
    """Rank `source`'s (FP8 [T, H], float32 scales [T, H / 128]) with arbitrary bytes, the scales
    strided (column-major), which DeepEP accepts."""
    g = torch.Generator().manual_seed(50 + source)
    x = torch.randint(0, 256, (T, H), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scales = torch.randn(H // 128, T, generator=g).t()
    return x, scales


def _expected_received(rank: int, rows_of):
    """What `rank` receives: every source's tokens with an expert on `rank`, by source then token;
    (x rows, relative top-k, weights, source index) as rows_of(source, token) gives them."""
    first, local = rank * E // R, E // R
    out = []
    for source in range(R):
        idx, weights, _ = _routing(source)
        for t in range(T):
            here = (idx[t] >= first) & (idx[t] < first + local)
            if here.any():
                out.append((rows_of(source, t), torch.where(here, idx[t] - first, -1),
                            torch.where(here, weights[t], 0.0), t))
    return out


def _check_buffer(rank: int) -> None:
    from deep_ep import Buffer, EventHandle, EventOverlap
    from megatron.core.transformer.moe.fused_a2a import get_buffer, get_hidden_bytes

    group = dist.group.WORLD
    idx, weights, x = _routing(rank)
    buffer = get_buffer(group, get_hidden_bytes(x))  # Megatron's sizing, through the hints
    assert isinstance(buffer, Buffer) and buffer.group_size == R and buffer.rank == rank
    assert buffer.num_nvl_bytes > 0 and buffer.num_rdma_bytes == 0 and not buffer.low_latency_mode

    # Layout.
    per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, E)
    valid = idx >= 0
    assert per_rdma_rank is None
    assert per_expert.dtype == per_rank.dtype == torch.int32 and in_rank.dtype == torch.bool
    assert per_expert.tolist() == [int((idx == e).sum()) for e in range(E)], f"rank {rank}: tokens per expert"
    assert per_expert[UNUSED_EXPERT] == 0
    expected_in_rank = torch.stack([((idx // (E // R) == d) & valid).any(1) for d in range(R)], dim=1)
    assert torch.equal(in_rank, expected_in_rank), f"rank {rank}: is_token_in_rank"
    assert per_rank.tolist() == expected_in_rank.sum(0).tolist(), f"rank {rank}: tokens per rank"

    # Dispatch.
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    recv_x, recv_idx, recv_w, counts, handle, event = buffer.dispatch(
        x, topk_idx=idx, topk_weights=weights, **layout)
    expected = _expected_received(rank, lambda source, t: _routing(source)[2][t])
    assert recv_x.shape == (len(expected), H) and recv_x.dtype == torch.bfloat16
    assert torch.equal(recv_x.view(torch.int16), torch.stack([e[0] for e in expected]).view(torch.int16)), \
        f"rank {rank}: received rows (order: source rank, then token)"
    assert torch.equal(recv_idx, torch.stack([e[1] for e in expected])), f"rank {rank}: relative top-k indices"
    assert torch.equal(recv_w, torch.stack([e[2] for e in expected])), f"rank {rank}: weights, 0 at -1"
    assert handle[4].tolist() == [e[3] for e in expected], f"rank {rank}: source token indices"
    hits = [int((recv_idx == j).sum()) for j in range(E // R)]
    assert counts == hits, f"rank {rank}: tokens per local expert {counts}, expected {hits}"
    assert isinstance(counts, list) and event.event is None

    # Combine: each token comes back once from each rank it went to.
    combined, combined_w, _ = buffer.combine(recv_x, handle, topk_weights=recv_w)
    ranks_of_token = in_rank.sum(1, keepdim=True).float()
    assert combined.dtype == torch.bfloat16
    assert torch.equal(combined.float(), x.float() * ranks_of_token), f"rank {rank}: combined rows"
    assert torch.equal(combined_w, torch.where(valid, weights, 0.0)), f"rank {rank}: combined weights"
    assert torch.equal(combined[0].float(), torch.zeros(H)), f"rank {rank}: a token sent nowhere comes back zero"
    combined_plain, none, _ = buffer.combine(recv_x, handle)
    assert none is None and torch.equal(combined_plain.view(torch.int16), combined.view(torch.int16))
    bias = torch.ones(T, H, dtype=torch.bfloat16)
    with_bias, _, _ = buffer.combine(recv_x, handle, bias=(bias, bias))
    assert torch.equal(with_bias.float(), combined.float() + 2), f"rank {rank}: combine with two biases"

    # Cached dispatch with the handle: the same rows, nothing else.
    again = buffer.dispatch(x, handle=handle)
    assert torch.equal(again[0].view(torch.int16), recv_x.view(torch.int16)) and again[1:5] == (None,) * 4, \
        f"rank {rank}: cached dispatch"
    try:
        buffer.dispatch(x, handle=handle, topk_idx=idx, topk_weights=weights)
        raise RuntimeError("cached dispatch took top-k")
    except AssertionError:
        pass

    # (FP8, scales): byte for byte, with top-k and cached.
    x8, scales = _fp8(rank)
    (recv_x8, recv_scales), recv_idx8, _, _, handle8, _ = buffer.dispatch(
        (x8, scales), topk_idx=idx, topk_weights=weights, **layout)
    expected8 = _expected_received(rank, lambda source, t: _fp8(source)[0][t].view(torch.uint8))
    expected_scales = _expected_received(rank, lambda source, t: _fp8(source)[1][t])
    assert recv_x8.dtype == torch.float8_e4m3fn and recv_scales.dtype == torch.float32
    assert torch.equal(recv_x8.view(torch.uint8), torch.stack([e[0] for e in expected8])), f"rank {rank}: FP8 bytes"
    assert torch.equal(recv_scales.view(torch.int32), torch.stack([e[0] for e in expected_scales]).view(torch.int32)), \
        f"rank {rank}: scales"
    assert recv_scales.is_contiguous() and torch.equal(recv_idx8, recv_idx)
    (cached8, cached_scales), *rest = buffer.dispatch((x8, scales), handle=handle8)
    assert torch.equal(cached8.view(torch.uint8), recv_x8.view(torch.uint8)) and torch.equal(cached_scales, recv_scales)

    # Alignment, and num_worst_tokens padding (combine reads the real rows only).
    *_, aligned, _, _ = buffer.dispatch(x, topk_idx=idx, topk_weights=weights, expert_alignment=4, **layout)
    assert aligned == [-(-n // 4) * 4 for n in hits], f"rank {rank}: aligned counts {aligned}"
    worst = len(expected) + 5
    padded_x, padded_idx, padded_w, empty, padded_handle, _ = buffer.dispatch(
        x, topk_idx=idx, topk_weights=weights, num_worst_tokens=worst, **layout)
    assert empty == [] and padded_x.size(0) == worst and torch.equal(padded_x[:len(expected)], recv_x)
    assert (padded_idx[len(expected):] == -1).all() and torch.equal(padded_idx[:len(expected)], recv_idx)
    assert torch.equal(padded_w[:len(expected)], recv_w)
    padded_combined, _, _ = buffer.combine(padded_x, padded_handle)
    assert torch.equal(padded_combined.view(torch.int16), combined.view(torch.int16))

    # A rank that sends nothing (rank 1: no experts), another that keeps everything (rank 0: local only).
    lonely = torch.full((T, K), -1, dtype=torch.int64)
    if rank == 0:
        lonely[:, 0] = 1
    per_rank0, _, per_expert0, in_rank0, _ = buffer.get_dispatch_layout(lonely, E)
    kept, _, _, counts0, handle0, _ = buffer.dispatch(
        x, topk_idx=lonely, topk_weights=weights, num_tokens_per_rank=per_rank0, is_token_in_rank=in_rank0,
        num_tokens_per_expert=per_expert0)
    assert kept.size(0) == (T if rank == 0 else 0) and counts0 == ([0, T, 0] if rank == 0 else [0, 0, 0])
    back, _, _ = buffer.combine(kept, handle0)
    assert torch.equal(back.float(), x.float() if rank == 0 else torch.zeros(T, H)), f"rank {rank}: one-sided"

    # The async arguments Megatron's FusedDispatch passes.
    per_rank_a, _, per_expert_a, in_rank_a, layout_event = buffer.get_dispatch_layout(
        idx, E, previous_event=EventOverlap(EventHandle()), async_finish=True, allocate_on_comm_stream=True)
    out = buffer.dispatch(x, topk_idx=idx, topk_weights=weights, num_tokens_per_rank=per_rank_a,
                          is_token_in_rank=in_rank_a, num_tokens_per_expert=per_expert_a,
                          previous_event=layout_event, async_finish=True, allocate_on_comm_stream=True)
    out[-1].current_stream_wait()
    assert torch.equal(out[0].view(torch.int16), recv_x.view(torch.int16))

    # Refusals.
    for call, error in ((lambda: buffer.combine(recv_x.float(), handle), AssertionError),
                        (lambda: Buffer(group, 0, 0, low_latency_mode=True), NotImplementedError),
                        (lambda: buffer.get_dispatch_layout(idx.int(), E), AssertionError),
                        (lambda: buffer.dispatch(x[:, :4].contiguous(), **layout), AssertionError),  # 8-byte rows
                        (lambda: buffer.dispatch((x8, scales.double()), **layout), AssertionError),
                        (lambda: Buffer.set_num_sms(3), AssertionError)):
        try:
            call()
        except error:
            continue
        raise RuntimeError(f"rank {rank}: accepted what DeepEP refuses ({error.__name__} expected)")


# ------------------------------------------------------------------------------------- MoE layer

# moe_layer_checks.EMULATED_SIZES
HIDDEN, EXPERTS, TOPK, FFN, TOKENS_PER_RANK = 256, 4, 2, 128, 64


def _config(dispatcher: str):
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=8, num_moe_experts=EXPERTS, moe_router_topk=TOPK,
        moe_ffn_hidden_size=FFN, moe_token_dispatcher_type=dispatcher, moe_flex_dispatcher_backend="deepep",
        moe_router_dtype="fp32", moe_aux_loss_coeff=1e-2, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16,
        tensor_model_parallel_size=1, expert_model_parallel_size=R, expert_tensor_parallel_size=1)


def _relative(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _check_moe_layer(rank: int) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe import fused_a2a
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher, MoEFlexTokenDispatcher

    import deep_ep
    from megatron_fp4.integration.standalone import build_moe_layer

    parallel_state.initialize_model_parallel(expert_model_parallel_size=R, expert_tensor_parallel_size=1)
    calls = []
    real_dispatch, real_combine = deep_ep.Buffer.dispatch, deep_ep.Buffer.combine

    def counted(name, real):
        def call(self, *args, **kwargs):
            calls.append(name)
            return real(self, *args, **kwargs)
        return call

    deep_ep.Buffer.dispatch = counted("dispatch", real_dispatch)
    deep_ep.Buffer.combine = counted("combine", real_combine)
    try:
        model_parallel_cuda_manual_seed(1234)
        flex = build_moe_layer(_config("flex")).cuda()
        stock = build_moe_layer(_config("alltoall")).cuda()
        stock.load_state_dict(flex.state_dict())
        assert isinstance(flex.token_dispatcher, MoEFlexTokenDispatcher)
        assert isinstance(stock.token_dispatcher, MoEAlltoAllTokenDispatcher)

        g = torch.Generator(device="cuda").manual_seed(1000 + rank)
        shape = (TOKENS_PER_RANK // 2, 2, HIDDEN)
        x = torch.randn(shape, device="cuda", generator=g).bfloat16()
        gy = torch.randn(shape, device="cuda", generator=g).bfloat16()
        results = {}
        for name, layer in (("flex", flex), ("stock", stock)):
            xi = x.clone().requires_grad_(True)
            out, _ = layer(xi)
            out.backward(gy)
            results[name] = {"output": out.detach(), "input grad": xi.grad,
                             **{n: p.grad for n, p in layer.named_parameters()}}
        # forward: dispatch, combine; backward: combine (dispatch's), cached dispatch (combine's)
        assert calls == ["dispatch", "combine", "dispatch", "combine"], f"rank {rank}: stand-in calls {calls}"
        assert isinstance(fused_a2a._buffer, deep_ep.Buffer)
        errors = {n: _relative(results["flex"][n], v) for n, v in results["stock"].items()}
        print(f"rank {rank} flex (DeepEP stand-in) vs alltoall, relative differences:",
              {n: f"{e:.1e}" for n, e in errors.items()}, flush=True)
        assert results["flex"].keys() == results["stock"].keys()
        bad = {n: e for n, e in errors.items() if not e < 1e-2}
        assert not bad, f"rank {rank}: flex through the stand-in differs from alltoall: {bad}"
    finally:
        deep_ep.Buffer.dispatch, deep_ep.Buffer.combine = real_dispatch, real_combine
        parallel_state.destroy_model_parallel()


SCENARIOS = {"buffer": _check_buffer, "moe-layer": _check_moe_layer}


def run_scenarios(rank: int, scratch: str, names) -> None:
    """tests/support/two_ranks.py's entry point: the stand-in installed, then each named scenario."""
    _install()
    for name in names:
        SCENARIOS[name](rank)
