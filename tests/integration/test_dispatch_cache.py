"""The recompute cache: bookkeeping on fake payloads (keyed per micro-batch, freed when taken, stale /
missing / mismatched entries refused), and the token replay on gloo (2 ranks): the same values and
gradients as sending again, with no forward all-to-all. (The probs are not cached: the recompute
sends its own through Megatron's all-to-all, see FP4AlltoAllTokenDispatcher.dispatch_fp4.)"""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_fp4.dispatch.cache import CachedDispatch, DispatchCache, DispatchCacheError, MicroBatchKey
from megatron_fp4.dispatch.alltoall_combine import AlltoAllSplits
from megatron_fp4.formats import mxfp4_wire_bytes_per_row
from megatron_fp4.tensors import MXFP4Tensor

HIDDEN = 256


def _entry(tokens: int, splits=((3, 2), (4, 1)), hidden: int = HIDDEN):
    rows = torch.randint(0, 255, (tokens, mxfp4_wire_bytes_per_row(hidden)), dtype=torch.uint8)
    return CachedDispatch(MXFP4Tensor(rows, hidden), AlltoAllSplits(*splits))


def test_keyed_per_micro_batch_and_freed_when_taken():
    cache = DispatchCache("layer 3")
    inputs = [torch.zeros(8, 2, HIDDEN) for _ in range(3)]  # three micro-batches in flight
    entries = [_entry(5) for _ in inputs]
    for x, entry in zip(inputs, entries):
        cache.store(MicroBatchKey.of(x), entry)
    assert len(cache) == 3 and cache.nbytes() == 3 * entries[0].nbytes()
    # The recompute of micro-batch 1 comes first here (any order works), through a detached view.
    assert cache.take(MicroBatchKey.of(inputs[1].detach())) is entries[1]
    assert cache.take(MicroBatchKey.of(inputs[0])) is entries[0]
    assert cache.take(MicroBatchKey.of(inputs[2])) is entries[2]
    assert len(cache) == 0 and cache.nbytes() == 0


def test_key_survives_megatrons_storage_release_and_rebind():
    """With `layernorm` recomputed, Megatron frees the MoE input's memory after forward
    (storage resized to 0) and re-points the same storage at new memory before the recompute:
    the key must name the storage object, not the data address."""
    x = torch.randn(64, 2, HIDDEN)
    before = MicroBatchKey.of(x)
    keep = torch.empty(1 << 20)  # occupy memory so the regrown storage lands elsewhere
    x.untyped_storage().resize_(0)
    x.untyped_storage().resize_(64 * 2 * HIDDEN * 4)
    assert MicroBatchKey.of(x.detach()) == before
    assert MicroBatchKey.of(x[1:]) != before  # another offset is another tensor
    assert MicroBatchKey.of(torch.randn(64, 2, HIDDEN)) != before
    del keep


def test_stale_missing_and_mismatched_entries_are_refused():
    cache = DispatchCache("layer 3")
    x = torch.zeros(8, 2, HIDDEN)
    cache.store(MicroBatchKey.of(x), _entry(5))
    with pytest.raises(DispatchCacheError, match="stale"):
        cache.store(MicroBatchKey.of(x), _entry(5))
    with pytest.raises(DispatchCacheError, match="no cached dispatch"):
        cache.take(MicroBatchKey.of(torch.zeros(8, 2, HIDDEN)))
    entry = cache.take(MicroBatchKey.of(x))
    assert len(cache) == 0  # taken out before it is checked: a refused entry is never served later
    entry.check(AlltoAllSplits((3, 2), (4, 1)), HIDDEN)
    with pytest.raises(DispatchCacheError, match="does not match"):
        entry.check(AlltoAllSplits((2, 3), (4, 1)), HIDDEN)
    with pytest.raises(DispatchCacheError, match="hidden"):
        entry.check(AlltoAllSplits((3, 2), (4, 1)), 2 * HIDDEN)


def test_cache_holds_under_27_percent_of_the_bf16_tokens():
    tokens, hidden = 64, 7168
    entry = _entry(tokens, hidden=hidden)
    bf16_bytes = tokens * hidden * 2
    assert entry.nbytes() == tokens * (hidden // 2 + hidden // 32)
    assert entry.nbytes() / bf16_bytes < 0.27


def _worker(rank: int, world: int, init_file: str, grad_format: str) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    from megatron_fp4.dispatch import fp4_dispatch_all_to_all
    from megatron_fp4.dispatch.replay import replay_tokens

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    calls = []
    real_all_to_all = dist.all_to_all_single

    def counting_all_to_all(*args, **kwargs):
        calls.append(args[0].dtype)
        return real_all_to_all(*args, **kwargs)

    dist.all_to_all_single = counting_all_to_all
    try:
        g = torch.Generator().manual_seed(rank)
        input_splits = [[3, 5], [4, 0]][rank]
        output_splits = [[3, 4], [5, 0]][rank]
        tokens = (torch.randn(sum(input_splits), HIDDEN, generator=g) * 8).bfloat16()
        grad = torch.randn(sum(output_splits), HIDDEN, generator=g).bfloat16()

        def dispatch(cached=None):
            t = tokens.clone().requires_grad_(True)
            if cached is None:
                received, payload = fp4_dispatch_all_to_all(t, output_splits, input_splits, grad_format=grad_format)
            else:
                payload = cached
                received = replay_tokens(t, payload, output_splits, input_splits, dist.group.WORLD, grad_format)
            forward_calls = len(calls)
            received.backward(grad)
            return received.detach(), payload, t.grad, forward_calls

        sent = dispatch()
        calls.clear()
        replayed = dispatch(cached=sent[1])
        assert replayed[3] == 0, "the replay sent something forward"
        assert len(calls) == 1, f"backward should send the gradient back once, sent {len(calls)}"
        assert torch.equal(replayed[0].view(torch.int16), sent[0].view(torch.int16))
        assert torch.equal(replayed[2].view(torch.int16), sent[2].view(torch.int16))
        # For experts that read the payload: the replay skips the dequantization, same gradient path.
        t = tokens.clone().requires_grad_(True)
        placeholder = replay_tokens(t, sent[1], output_splits, input_splits, dist.group.WORLD, grad_format,
                                    dequantize=False)
        assert placeholder.shape == sent[0].shape and placeholder.dtype == sent[0].dtype
        placeholder.backward(grad)
        assert torch.equal(t.grad.view(torch.int16), sent[2].view(torch.int16))
    finally:
        dist.all_to_all_single = real_all_to_all
        dist.destroy_process_group()


@pytest.mark.parametrize("grad_format", ["bf16", "fp8"])
def test_replay_equals_sending_again_without_forward_all_to_all(grad_format):
    if torch.cuda.is_available():
        pytest.skip("the gloo test runs on CPU machines; the GPU path is tested through the MoE layer")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(2, os.path.join(tmp, "init"), grad_format), nprocs=2, join=True)


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_replay_hands_on_the_recomputes_own_probs(one_rank_group):
    """Megatron's router sorts its top-k only with grad on, so a recompute can compute probs one BF16
    unit apart from its first pass: the replay must pass on this pass's probs (and their gradient),
    with the cached tokens."""
    from megatron_fp4.dispatch.token_dispatcher import FP4AlltoAllTokenDispatcher
    from megatron_fp4.kernels import dequantize_mxfp4, quantize_mxfp4
    from megatron_fp4.options import FP4Options

    dispatcher = object.__new__(FP4AlltoAllTokenDispatcher)  # only what dispatch_fp4 reads
    dispatcher.options = FP4Options(dispatch=True, cache=True)
    dispatcher.ep_group, dispatcher.use_nccl_stream = one_rank_group, False
    dispatcher.output_splits = dispatcher.input_splits = None
    dispatcher.shared_experts, dispatcher.tokens_per_expert, dispatcher.ep_size = None, None, 1
    dispatcher._maybe_dtoh_and_synchronize = lambda point, tokens_per_expert: tokens_per_expert  # the parent's sync
    g = torch.Generator().manual_seed(7)
    tokens = (torch.randn(6, HIDDEN, generator=g) * 4).bfloat16()
    payload = quantize_mxfp4(tokens)

    recompute_probs = torch.rand(6, generator=g).requires_grad_(True)
    received, received_probs = dispatcher.dispatch_fp4(tokens.clone().requires_grad_(True), recompute_probs,
                                                       dequantize=True,
                                                       replay=CachedDispatch(payload, AlltoAllSplits((6,), (6,))))
    assert torch.equal(received_probs, recompute_probs)
    assert received.payload is payload and received.handle == AlltoAllSplits((6,), (6,))
    assert torch.equal(received.tokens.view(torch.int16), dequantize_mxfp4(payload).bfloat16().view(torch.int16))
    (received_probs * torch.arange(6.0)).sum().backward()
    assert torch.equal(recompute_probs.grad, torch.arange(6.0))
