"""The DeepGEMM peer's layout conversions (benchmarks/deepgemm_peer.py) on the CPU, against a stand-in
written here from DeepGEMM's documented call contract: the contiguous layout's aligned row groups and
row-to-expert map (-1 for padding), its K-grouped weight gradient over per-expert K-major blocks, its
dense GEMM, and MN-major FP32 activation scales. The stand-in computes in float64 from the FP8
values and scales it is handed, so a mistake in what the peer hands it (a row in the wrong group, a
scale of another row, a transposed block) changes the product; the expected products come from the
reference quantizers' dequantized operands, independently of the peer's code."""

import sys
from pathlib import Path

import pytest
import torch

from megatron_fp4 import reference as R
from megatron_fp4.formats import FP8_BLOCK
from megatron_fp4.tensors import FP8StackedWeights

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import deepgemm_peer as peer  # noqa: E402

ALIGNMENT = 128
COUNTS = [5, 0, 130, 1]  # an empty expert, one over the alignment, a single row


def _blocks(scales: torch.Tensor, block_rows: int, rows: int, cols: int) -> torch.Tensor:
    """Per-element scales from [rows / block_rows, cols / 128] block scales."""
    return scales.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols].double()


class StandIn:
    """DeepGEMM's three calls as the peer uses them, in float64."""

    def get_mk_alignment_for_contiguous_layout(self):
        return ALIGNMENT

    def m_grouped_fp8_gemm_nt_contiguous(self, a, b, d, expert_of_row, disable_ue8m0_cast):
        (data, scales), (weights, weight_scales) = a, b
        assert data.shape[0] % ALIGNMENT == 0 and scales.shape == (data.shape[0], data.shape[1] // FP8_BLOCK)
        assert scales.stride(0) == 1, "activation scales are read MN-major"
        x = data.double() * scales.double().repeat_interleave(FP8_BLOCK, 1)
        out = torch.zeros(d.shape, dtype=torch.float64)
        for row, expert in enumerate(expert_of_row.tolist()):
            if expert >= 0:
                assert row % ALIGNMENT == 0 or expert_of_row[row - 1] == expert, "each group starts aligned"
                n, k = weights.shape[1:]
                w = weights[expert].double() * _blocks(weight_scales[expert], FP8_BLOCK, n, k)
                out[row] = w @ x[row]
        d.copy_(out)

    def k_grouped_fp8_gemm_nt_contiguous(self, a, b, d, ks, ks_tensor, c):
        (flat_a, scale_a), (flat_b, scale_b) = a, b
        assert ks_tensor.tolist() == ks and all(k % FP8_BLOCK == 0 for k in ks) and c is d
        num_groups, m, n = d.shape
        start = 0
        for group, k in enumerate(ks):
            block_a = flat_a[start * m:(start + k) * m].view(m, k).double()
            block_b = flat_b[start * n:(start + k) * n].view(n, k).double()
            cols = slice(start // FP8_BLOCK, (start + k) // FP8_BLOCK)
            block_a = block_a * scale_a[:, cols].double().repeat_interleave(FP8_BLOCK, 1)
            block_b = block_b * scale_b[:, cols].double().repeat_interleave(FP8_BLOCK, 1)
            d[group] += (block_a @ block_b.T).float()
            start += k

    def fp8_gemm_nt(self, a, b, d, disable_ue8m0_cast):
        (data, scales), (weight, weight_scales) = a, b
        x = data.double() * scales.double().repeat_interleave(FP8_BLOCK, 1)
        w = weight.double() * _blocks(weight_scales, FP8_BLOCK, *weight.shape)
        d.copy_((x @ w.T).to(d.dtype))


def _operands(n=256, k=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(COUNTS), k, generator=g)
    # A 2^20 range inside one row and a zero row, so a scale taken from the wrong row shows.
    x[3, :FP8_BLOCK] *= 2.0 ** 20
    x[7] = 0
    rows = R.quantize_fp8_rows(x)
    weights = [R.quantize_fp8_weight(torch.randn(n, k, generator=g)) for _ in COUNTS]
    stacked = FP8StackedWeights(torch.stack([w.data for w in weights]), torch.stack([w.block_scales for w in weights]))
    return rows, weights, stacked


def test_rows_call_puts_each_expert_on_an_aligned_group_and_counts_real_rows_only():
    rows, weights, stacked = _operands()
    call = peer.rows_call(StandIn(), rows, stacked, COUNTS)
    call.run()
    x = R.dequantize_fp8(rows, torch.float64)
    start, expected = 0, []
    for count, weight in zip(COUNTS, weights):
        expected.append(x[start:start + count] @ R.dequantize_fp8_weight(weight, torch.float64).T)
        start += count
    expected = torch.cat(expected)
    assert peer.relative_error(call.output(), expected) < 2.0 ** -8
    n, k = weights[0].shape
    assert call.useful_flops == 2.0 * sum(COUNTS) * n * k
    assert call.padding_rows == sum(-(-c // ALIGNMENT) * ALIGNMENT for c in COUNTS) - sum(COUNTS) == 128 + 256 + 128 - 136


def test_wgrad_call_hands_each_segment_as_its_own_k_major_block():
    g = torch.Generator().manual_seed(1)
    n, k = 128, 256
    grad, x = torch.randn(sum(COUNTS), n, generator=g), torch.randn(sum(COUNTS), k, generator=g)
    counts = torch.tensor(COUNTS)
    grad_cols, x_cols = R.quantize_fp8_cols(grad, counts), R.quantize_fp8_cols(x, counts)
    call = peer.wgrad_call(StandIn(), grad_cols, x_cols)
    call.run()
    dy, xt = R.dequantize_fp8(grad_cols, torch.float64), R.dequantize_fp8(x_cols, torch.float64)
    offsets = grad_cols.segment_offsets.tolist()
    expected = torch.stack([dy[:, s:e] @ xt[:, s:e].T for s, e in zip(offsets, offsets[1:])])
    assert peer.relative_error(call.output(), expected) < 2.0 ** -20  # FP32 sums of exact products
    assert call.useful_flops == 2.0 * offsets[-1] * n * k


def test_dense_call_and_a_disagreement_is_not_timed():
    rows, weights, stacked = _operands(seed=2)
    call = peer.dense_call(StandIn(), rows, stacked)
    expected = R.dequantize_fp8(rows, torch.float64) @ R.dequantize_fp8_weight(weights[0], torch.float64).T
    timed = []
    rate, error = peer.checked_rate("dense", call, expected, lambda fn: timed.append(fn) or 1.0)
    assert error < 2.0 ** -8 and timed and rate == call.useful_flops / 1e9
    timed.clear()
    rate, error = peer.checked_rate("dense", call, expected * 1.01, lambda fn: timed.append(fn) or 1.0)
    assert rate is None and error > 2.0 ** -8 and not timed


def test_load_says_why_where_deep_gemm_is_missing(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # the import then raises ModuleNotFoundError
    assert peer.load() is None
    assert "DeepGEMM not measured: import deep_gemm failed (ModuleNotFoundError" in capsys.readouterr().out
