"""The FP4 dispatch all-to-all on real process groups (gloo, CPU; the Triton kernels run under the
interpreter): rows land on the right ranks, the payload is H/2 + H/32 bytes per token, and the
gradient comes back through the reversed all-to-all."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN = 256


def _splits(world: int) -> torch.Tensor:
    """sent[s, d]: tokens rank s sends to rank d, the same on every rank; some are zero."""
    g = torch.Generator().manual_seed(world)
    sent = torch.randint(0, 9, (world, world), generator=g)
    sent[0, world - 1] = 0
    return sent


def _tokens(rank: int, count: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(count, HIDDEN, generator=g) * torch.exp2(torch.randint(-6, 6, (count, HIDDEN), generator=g).float())
    return x.bfloat16()


def _grad(rank: int, count: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(200 + rank)
    return torch.randn(count, HIDDEN, generator=g).bfloat16()


def _worker(rank: int, world: int, init_file: str, grad_formats) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for grad_format in grad_formats:  # one process group for all: the processes' start-up once
            _check(rank, world, grad_format)
    finally:
        dist.destroy_process_group()


def _check(rank: int, world: int, grad_format: str) -> None:
    from megatron_fp4 import reference as ref
    from megatron_fp4.dispatch import fp4_dispatch_all_to_all
    from megatron_fp4.formats import mxfp4_wire_bytes_per_row

    where = f"rank {rank} of {world}, gradient {grad_format}"
    sent = _splits(world)
    input_splits = sent[rank].tolist()
    output_splits = sent[:, rank].tolist()
    tokens = _tokens(rank, sum(input_splits)).requires_grad_(True)
    received, payload = fp4_dispatch_all_to_all(tokens, output_splits, input_splits, grad_format=grad_format)

    # Forward: the rows of every source rank addressed to me, in source order, each the
    # reference MXFP4 rounding of the sender's token.
    assert payload.rows.shape == (sum(output_splits), mxfp4_wire_bytes_per_row(HIDDEN)), where
    assert payload.rows.shape[1] == HIDDEN // 2 + HIDDEN // 32, where
    expected_rows = []
    for source in range(world):
        source_tokens = _tokens(source, int(sent[source].sum()))
        start = int(sent[source, :rank].sum())
        expected_rows.append(source_tokens[start : start + int(sent[source, rank])])
    expected = torch.cat(expected_rows)
    q = ref.quantize_mxfp4(expected)
    assert torch.equal(payload.rows, q.rows), where
    assert torch.equal(received.view(torch.int16), ref.dequantize_mxfp4(q).view(torch.int16)), where

    # Backward: straight through the quantization, the gradient rows sent back to their tokens.
    received.backward(_grad(rank, received.shape[0]))
    expected_grad = []
    for dest in range(world):
        dest_grad = _grad(dest, int(sent[:, dest].sum()))
        if grad_format == "fp8":
            dest_grad = ref.dequantize_fp8(ref.quantize_fp8_rows(dest_grad))
        start = int(sent[:rank, dest].sum())
        expected_grad.append(dest_grad[start : start + int(sent[rank, dest])])
    assert tokens.grad.dtype == torch.bfloat16, where
    assert torch.equal(tokens.grad.view(torch.int16), torch.cat(expected_grad).view(torch.int16)), where

    # For experts that read the payload: the same payload and gradient path, no dequantization.
    again = tokens.detach().clone().requires_grad_(True)
    placeholder, same_payload = fp4_dispatch_all_to_all(again, output_splits, input_splits,
                                                        grad_format=grad_format, dequantize=False)
    assert torch.equal(same_payload.rows, q.rows), where
    assert placeholder.shape == received.shape and placeholder.dtype == received.dtype, where
    placeholder.backward(_grad(rank, received.shape[0]))
    assert torch.equal(again.grad.view(torch.int16), tokens.grad.view(torch.int16)), where


# world 1: a single EP rank has nothing to exchange (the rows are kept), the rounding still applies.
# Both gradient formats run in one group of processes per world size.
@pytest.mark.parametrize("world", [1, 2, 4])
def test_fp4_dispatch_all_to_all(world):
    if torch.cuda.is_available():
        pytest.skip("the gloo test runs on CPU machines; the GPU path is tested through the MoE layer")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, os.path.join(tmp, "init"), ("bf16", "fp8")), nprocs=world, join=True)


def test_refuses_bad_arguments():
    from megatron_fp4.dispatch import fp4_dispatch_all_to_all

    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="input_splits"):
        fp4_dispatch_all_to_all(x, [4], [3])
    with pytest.raises(ValueError, match="grad_format"):
        fp4_dispatch_all_to_all(x, [4], [4], grad_format="fp16")
    with pytest.raises(ValueError, match="scale_rule"):
        fp4_dispatch_all_to_all(x, [4], [4], scale_rule="nearest")
    with pytest.raises(ValueError, match="float16"):
        fp4_dispatch_all_to_all(x.half(), [4], [4])
    from megatron_fp4.tensors import MXFP4Tensor

    for rows, rule in ((MXFP4Tensor.empty(3, 256, x.device), "ceil"), (MXFP4Tensor.empty(4, 256, x.device, "floor"),
                                                                       "ceil")):
        with pytest.raises(ValueError, match="quantized rows"):  # rows quantized before the permute must match
            fp4_dispatch_all_to_all(x, [4], [4], scale_rule=rule, quantized=rows)

