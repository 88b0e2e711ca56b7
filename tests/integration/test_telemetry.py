"""megatron_fp4.telemetry (--moe-fp4-telemetry) on the CPU: the bytes of a dispatch by formula, the
sampled quantization error against the reference, the held FP4 bytes, no host read while recording
and one per read, the reduction over two gloo ranks, and Megatron's MoE metrics tracker carrying
the numbers (megatron_fp4.launch.telemetry_log). The whole training loop:
tests/launch/test_telemetry_log.py; the FP8 experts' and saved-input counts: their own tests."""

import math
import os
import tempfile
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_fp4 import reference as ref
from megatron_fp4.formats import fp8_wire_bytes_per_row, mxfp4_wire_bytes_per_row
from megatron_fp4.telemetry import SAMPLED_ROWS, Telemetry

from support.telemetry_training import Writer, counting_host_reads

HIDDEN = 256


def _tokens(rows, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-6, 6, (rows, 1), generator=g).float())
    return (torch.randn(rows, HIDDEN, generator=g) * scale).bfloat16().to(device)


def _dispatch(telemetry, sent_rows, received_rows, grad_format="bf16", replayed=False, scale_rule="ceil", seed=0,
              scale=1.0, device="cpu"):
    """One dispatch of sent_rows tokens that delivered received_rows, and its backward."""
    tokens = _tokens(sent_rows, seed, device) * scale
    received = _tokens(received_rows, seed + 1, device).requires_grad_(True)
    out = telemetry.dispatched(tokens, received, replayed, scale_rule, grad_format)
    (out.float() * 3).sum().backward()
    assert torch.equal(received.grad, torch.full_like(received, 3.0)), "the gradient must pass unchanged"
    return tokens


def test_dispatch_bytes_by_formula_per_step(device):
    telemetry = Telemetry()
    _dispatch(telemetry, 70, 50, device=device)  # first pass: MXFP4 forward, BF16 gradient back
    _dispatch(telemetry, 70, 50, replayed=True, device=device)  # a recompute served by the cache: nothing forward
    _dispatch(telemetry, 40, 30, grad_format="fp8", device=device)
    telemetry.end_step()
    telemetry.end_step()
    numbers = telemetry.read()
    mxfp4, fp8, bf16 = mxfp4_wire_bytes_per_row(HIDDEN), fp8_wire_bytes_per_row(HIDDEN), 2 * HIDDEN
    assert (mxfp4, fp8) == (HIDDEN // 2 + HIDDEN // 32, HIDDEN + 4 * HIDDEN // 128)
    assert numbers.steps == 2  # means per step
    assert numbers.dispatch_forward_bytes == (70 + 40) * mxfp4 / 2
    assert numbers.dispatch_forward_bf16_bytes == (70 + 70 + 40) * bf16 / 2
    assert numbers.dispatch_backward_bytes == (50 * bf16 + 50 * bf16 + 30 * fp8) / 2
    assert numbers.dispatch_backward_bf16_bytes == (50 + 50 + 30) * bf16 / 2
    assert numbers.cache_hits == 0.5
    assert telemetry.read() is None  # counting afresh: no step ended since


def test_a_dispatch_without_backward_counts_no_gradient(device):
    telemetry = Telemetry()
    received = _tokens(8, device=device)  # a no-grad pass (a checkpoint's first pass): nothing comes back
    assert telemetry.dispatched(_tokens(8, device=device), received, False, "ceil", "bf16") is received
    telemetry.end_step()
    numbers = telemetry.read()
    assert numbers.dispatch_backward_bytes == 0 and numbers.dispatch_forward_bytes > 0


@pytest.mark.parametrize("rows, scale_rule", [(200, "ceil"), (40, "floor"), (64 * 7 + 5, "ceil")])
def test_error_is_the_reference_quantization_error_of_the_sampled_rows(rows, scale_rule, device):
    telemetry = Telemetry()
    tokens = _dispatch(telemetry, rows, 4, scale_rule=scale_rule, device=device)
    telemetry.end_step()
    sample = tokens[:: max(1, rows // SAMPLED_ROWS)][:SAMPLED_ROWS].float()
    assert sample.shape[0] == min(rows, SAMPLED_ROWS)
    error = ref.dequantize_mxfp4(ref.quantize_mxfp4(tokens, scale_rule), dtype=torch.float32)[
        :: max(1, rows // SAMPLED_ROWS)][:SAMPLED_ROWS] - sample
    expected = math.sqrt(error.double().square().sum() / sample.double().square().sum())
    assert telemetry.read().relative_rms_error == pytest.approx(expected, rel=1e-5)
    assert 0.01 < expected < 0.3


def test_error_pools_the_samples_of_a_step_and_is_none_without_any(device):
    telemetry = Telemetry()
    small = _dispatch(telemetry, 10, 4, seed=3, device=device)
    large = _dispatch(telemetry, 10, 4, seed=5, scale=64.0, device=device)  # weighs 4096 times more
    _dispatch(telemetry, 10, 4, replayed=True, device=device)  # a replay quantizes nothing
    telemetry.end_step()
    sums = []
    for tokens in (small, large):
        x = tokens.float()
        sums.append(((ref.dequantize_mxfp4(ref.quantize_mxfp4(tokens), dtype=torch.float32) - x).square().sum(),
                     x.square().sum()))
    pooled = math.sqrt(sum(e for e, _ in sums) / sum(s for _, s in sums))
    assert telemetry.read().relative_rms_error == pytest.approx(pooled, rel=1e-5)
    telemetry.end_step()
    assert telemetry.read().relative_rms_error is None


def test_held_fp4_bytes_peak_per_read():
    telemetry = Telemetry()
    telemetry.hold(100)  # e.g. two cached payloads
    telemetry.hold(50)
    telemetry.release(100)
    telemetry.hold(300)  # the experts' saved activations
    telemetry.release(300)
    telemetry.end_step()
    assert telemetry.read().fp4_held_peak_bytes == 350
    telemetry.end_step()
    assert telemetry.read().fp4_held_peak_bytes == 50  # still held, and nothing more


def test_recording_reads_nothing_from_the_device_and_read_once(device):
    telemetry = Telemetry()
    reads = []
    with counting_host_reads(reads):
        _dispatch(telemetry, 200, 120, device=device)
        _dispatch(telemetry, 200, 120, grad_format="fp8", replayed=True, device=device)
        telemetry.hold(10)
        telemetry.release(10)
        telemetry.end_step()
    assert reads == []
    with counting_host_reads(reads):
        numbers = telemetry.read()
    assert reads == [["tolist", True]]  # (the training-loop test tells telemetry's reads by this flag)
    assert numbers.relative_rms_error is not None


def test_scalars_and_log_text(device):
    telemetry = Telemetry()
    _dispatch(telemetry, 64, 64, device=device)
    telemetry.hold(3 * 2**20)
    telemetry.end_step()
    numbers = telemetry.read()
    scalars = numbers.scalars()
    assert set(scalars) == {"fp4/dispatch-forward-bytes", "fp4/dispatch-forward-bytes-bf16",
                            "fp4/dispatch-backward-bytes", "fp4/dispatch-backward-bytes-bf16", "fp4/cache-hits",
                            "fp4/held-peak-bytes", "fp4/dispatch-relative-rms-error"}
    assert scalars["fp4/dispatch-forward-bytes"] == 64 * 136
    text = numbers.log_text()
    assert text.startswith(" fp4 dispatch fwd MB: 0.009 (bf16 0.033) | fp4 dispatch bwd MB: 0.033 (bf16 0.033) |")
    assert text.endswith(" | fp4 cache hits: 0.0 | fp4 held peak MiB: 3.000 |")
    assert f" fp4 rel rms error: {numbers.relative_rms_error:.3E} |" in text


def _reduce_worker(rank, world, init_file):
    os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        telemetry = Telemetry()
        sent = _dispatch(telemetry, 32 * (rank + 1), 16 * (rank + 1), seed=rank)
        telemetry.hold(1000 * (rank + 1))
        telemetry.release(1000 * (rank + 1))
        telemetry.end_step()
        numbers = telemetry.read()
        x = sent.float()
        mine = torch.stack([(ref.dequantize_mxfp4(ref.quantize_mxfp4(sent), dtype=torch.float32) - x).square().sum(),
                            x.square().sum()]).double()
        dist.all_reduce(mine)
        rows = 32 + 64  # over both ranks
        assert numbers.dispatch_forward_bytes == rows * mxfp4_wire_bytes_per_row(HIDDEN) / world  # mean per GPU
        assert numbers.dispatch_backward_bytes == rows / 2 * 2 * HIDDEN / world
        assert numbers.fp4_held_peak_bytes == 2000  # the largest on any rank
        assert numbers.relative_rms_error == pytest.approx(math.sqrt(mine[0] / mine[1]), rel=1e-6)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.is_available(), reason="two gloo ranks on the CPU")
def test_read_reduces_over_the_ranks():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_reduce_worker, args=(2, os.path.join(tmp, "init")), nprocs=2, join=True)


@pytest.fixture
def one_rank():
    from megatron.core import parallel_state

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_megatrons_moe_tracker_carries_the_numbers_at_logged_iterations(one_rank, monkeypatch, device):
    from megatron.core.transformer.moe import moe_logging

    from megatron_fp4.launch import telemetry_log

    monkeypatch.setattr(moe_logging, "_MOE_METRICS_TRACKER", None)
    recorder = Telemetry()
    monkeypatch.setattr("megatron_fp4.telemetry._RECORDER", recorder)
    moe_logging.get_moe_metrics_tracker().record("load_balancing_loss", torch.tensor(0.5), 1, 2)
    args = SimpleNamespace(moe_fp4_dispatch=True, moe_fp4_telemetry=True, log_interval=2)
    assert not telemetry_log.install(SimpleNamespace(moe_fp4_dispatch=True, log_interval=2))
    assert telemetry_log.install(args) and telemetry_log.install(args)  # once, however often asked
    tracker = moe_logging.get_moe_metrics_tracker()
    assert isinstance(tracker, telemetry_log.TrackerWithTelemetry) and tracker.recorder is recorder
    writer, wandb = Writer(), Writer()

    def report(iteration):  # as Megatron's training_log calls it
        return tracker.report(loss_scale=1.0, iteration=iteration, writer=writer, wandb_writer=wandb,
                              per_layer_logging=False, force_initialize=True, track_names=["load_balancing_loss"],
                              num_layers=2, moe_layer_freq=1, mtp_num_layers=None, pg_collection=None,
                              total_loss_dict={})

    _dispatch(recorder, 64, 64, device=device)
    assert report(1) == ""  # not a logged iteration; Megatron's own metric kept and reported as before
    assert ["load_balancing_loss", 0.25, 1] in writer.scalars
    _dispatch(recorder, 64, 64, device=device)
    text = report(2)
    assert text.startswith(" fp4 dispatch fwd MB: 0.009 (bf16 0.033) |")  # the mean of the two steps
    for w in (writer, wandb):
        assert ["fp4/dispatch-forward-bytes", 64.0 * 136, 2] in w.scalars
        assert ["fp4/cache-hits", 0.0, 2] in w.scalars
