"""GPU-only checks at realistic sizes (marker `gpu`; CI skips them): bit-exactness of every kernel
against the reference at 16384 x 7168, and the scale layouts fed to a real
torch.nn.functional.scaled_mm on SM90 against a float64 product."""

import sys
from pathlib import Path

import pytest
import torch

import megatron_fp4 as mf
from megatron_fp4 import reference as ref
from megatron_fp4.kernels import fp8_quantize, fp8_quantize_both, fp8_quantize_cols, fp8_quantize_weight

from support.inputs import assert_same_bits, assert_same_fp8, assert_same_mxfp4, hard_input

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ is a folder of the repository

from benchmarks.common import ragged_counts  # noqa: E402  (random expert sizes, a quarter empty)

pytestmark = pytest.mark.gpu

TOKENS, HIDDEN = 16384, 7168


@pytest.fixture(scope="module")
def activations() -> torch.Tensor:
    return hard_input(TOKENS, HIDDEN, torch.bfloat16, seed=2024, device="cuda")


@pytest.mark.parametrize("scale_rule", ["ceil", "floor"])
def test_quantize_and_dequantize_large(activations, scale_rule):
    q = mf.quantize_mxfp4(activations, scale_rule)
    assert_same_mxfp4(q, ref.quantize_mxfp4(activations, scale_rule))
    assert_same_bits(mf.dequantize_mxfp4(q), ref.dequantize_mxfp4(q))


def test_fp4_to_fp8_rows_large(activations):
    q = mf.quantize_mxfp4(activations)
    assert_same_fp8(mf.mxfp4_to_fp8_rows(q), ref.mxfp4_to_fp8_rows(q))


def test_fp4_to_fp8_cols_large_ragged(activations):
    q = mf.quantize_mxfp4(activations)
    counts = ragged_counts(TOKENS, 32, seed=5)
    assert (counts == 0).any() and int(counts.sum()) == TOKENS
    got = mf.mxfp4_to_fp8_cols(q, counts.cuda())
    assert_same_fp8(got, ref.mxfp4_to_fp8_cols(q, counts.tolist()))


def test_fp8_cols_large_ragged(activations):
    """The ragged BF16 -> FP8 column kernel (the wgrad gradient operand) at full size; added after
    this session's GPU time ran out, so first run on the next device call."""
    counts = ragged_counts(TOKENS, 32, seed=6)
    assert (counts == 0).any() and int(counts.sum()) == TOKENS
    got = mf.quantize_fp8_cols(activations, counts.cuda())
    assert_same_fp8(got, ref.quantize_fp8_cols(activations, counts.tolist()))


def test_fp8_rows_large(activations):
    t = mf.quantize_fp8_rows(activations)
    assert_same_fp8(t, ref.quantize_fp8_rows(activations))
    assert_same_bits(mf.dequantize_fp8(t), ref.dequantize_fp8(t))


@pytest.mark.parametrize("config", fp8_quantize.CONFIGS, ids=str)
def test_fp8_rows_large_every_config(activations, config):
    """Every candidate the benchmark sweeps, compiled, at full size (the CPU tests run them under
    the interpreter, which does not show what the compiler does with the fp32 rounding add)."""
    assert_same_fp8(mf.quantize_fp8_rows(activations, config), ref.quantize_fp8_rows(activations))


@pytest.mark.parametrize("config", fp8_quantize_cols.CONFIGS, ids=str)
def test_fp8_cols_large_ragged_every_config(activations, config):
    counts = ragged_counts(TOKENS, 32, seed=6)
    got = mf.quantize_fp8_cols(activations, counts.cuda(), config=config)
    assert_same_fp8(got, ref.quantize_fp8_cols(activations, counts.tolist()))


@pytest.mark.parametrize("config", fp8_quantize_both.CONFIGS, ids=str)
def test_fp8_rows_and_cols_large_ragged_every_config(activations, config):
    counts = ragged_counts(TOKENS, 32, seed=7)
    rows, cols = mf.quantize_fp8_rows_and_cols(activations, counts.cuda(), config=config)
    assert_same_fp8(rows, ref.quantize_fp8_rows(activations))
    assert_same_fp8(cols, ref.quantize_fp8_cols(activations, counts.tolist()))


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("config", fp8_quantize_weight.CONFIGS, ids=str)
def test_fp8_weight_large_every_config(activations, config, transpose):
    got = mf.quantize_fp8_weight(activations, transpose=transpose, config=config)
    expected = ref.quantize_fp8_weight(activations, transpose=transpose)
    assert_same_bits(got.data, expected.data)
    assert_same_bits(got.block_scales, expected.block_scales)


def _relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.double() - expected).norm() / expected.norm()).item()


def _scaled_mm(a: mf.FP8BlockTensor, b_data_t: torch.Tensor, b_scales: torch.Tensor) -> torch.Tensor:
    F = torch.nn.functional
    return F.scaled_mm(
        a.data,
        b_data_t,
        a.scaled_mm_scales(),
        F.ScalingType.BlockWise1x128,
        b_scales,
        F.ScalingType.BlockWise1x128,
        output_dtype=torch.bfloat16,
    )


def test_scaled_mm_fprop_takes_fp4_rows():
    """Y = X W^T with X from the FP4 -> FP8 row kernel (M=2048, K=7168, N=1536: non-square)."""
    x = hard_input(2048, HIDDEN, torch.bfloat16, seed=7, device="cuda")
    x = torch.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)
    a = mf.mxfp4_to_fp8_rows(mf.quantize_mxfp4(x))
    w = mf.quantize_fp8_rows(torch.randn(1536, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02)
    out = _scaled_mm(a, w.data.t(), w.scaled_mm_scales())
    expected = ref.dequantize_fp8(a, torch.float64) @ ref.dequantize_fp8(w, torch.float64).t()
    err = _relative_error(out, expected)
    print(f"fprop scaled_mm relative error {err:.2e}")
    assert err < 1e-2


def test_scaled_mm_wgrad_takes_fp4_columns_per_expert():
    """dW_e = dY_e^T X_e per expert, X_e^T from the ragged column kernel, dY_e^T in 1x128 rows."""
    tokens, ffn, experts = 4096, 1024, 8
    x = hard_input(tokens, HIDDEN, torch.bfloat16, seed=8, device="cuda")
    x = torch.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)
    counts = ragged_counts(tokens, experts, seed=9)
    cols = mf.mxfp4_to_fp8_cols(mf.quantize_mxfp4(x), counts.cuda())
    offsets = cols.segment_offsets.tolist()
    grad = torch.randn(tokens, ffn, device="cuda", dtype=torch.bfloat16)
    first = 0
    checked = 0
    for e, count in enumerate(counts.tolist()):
        start, end = offsets[e], offsets[e + 1]
        if count == 0:
            assert start == end
            continue
        grad_t = torch.zeros(ffn, end - start, device="cuda", dtype=torch.bfloat16)
        grad_t[:, :count] = grad[first : first + count].t()
        first += count
        a = mf.quantize_fp8_rows(grad_t)
        b_data_t = cols.data[:, start:end].t()
        b_scales = cols.block_scales[start // 128 : end // 128].t()
        out = _scaled_mm(a, b_data_t, b_scales)
        x_e = ref.dequantize_fp8(cols, torch.float64)[:, start:end]
        expected = ref.dequantize_fp8(a, torch.float64) @ x_e.t()
        err = _relative_error(out, expected)
        assert err < 1e-2, f"expert {e}: relative error {err:.2e}"
        checked += 1
    assert checked >= experts - experts // 4
