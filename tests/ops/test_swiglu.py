"""The experts' SwiGLU backward kernel against its definition in torch ops (eager, fp32)."""

import pytest
import torch

from megatron_fp4.kernels import swiglu
from megatron_fp4.kernels.swiglu import swiglu_with_probs_backward, swiglu_with_probs_backward_eager


def _inputs(device, tokens, ffn, seed):
    g = torch.Generator().manual_seed(seed)
    fc1_out = (torch.randn(tokens, 2 * ffn, generator=g) * 4).bfloat16()
    fc1_out[:1, :3] = torch.tensor([0.0, -80.0, 80.0])  # zero and saturated gates
    probs = torch.rand(tokens, generator=g)
    grad = torch.randn(tokens, ffn, generator=g).bfloat16()
    return fc1_out.to(device), probs.to(device), grad.to(device)


@pytest.fixture(params=["gpu_rows", "interpreter_rows"])  # not "gpu": that keyword marks GPU-only tests
def backward_rows_per_program(request, monkeypatch):
    """The backward kernel at the GPU's rows per program and at the interpreter's (what CPU runs
    launch by default), wherever the test runs: CI checks the GPU's tiling too."""
    rows = swiglu.GPU_BLOCK_ROWS if request.param == "gpu_rows" else swiglu.INTERPRETER_BLOCK_ROWS
    monkeypatch.setattr(swiglu, "GPU_BLOCK_ROWS", rows)
    monkeypatch.setattr(swiglu, "INTERPRETER_BLOCK_ROWS", rows)
    return rows


@pytest.mark.parametrize("tokens, ffn, offset", [(37, 384, 0.0), (5, 2048, 1.0), (0, 256, 0.0)])
def test_swiglu_backward_kernel_matches_its_definition(device, tokens, ffn, offset, backward_rows_per_program):
    fc1_out, probs, grad = _inputs(device, tokens, ffn, seed=tokens + ffn)
    got_fc1, got_probs = swiglu_with_probs_backward(fc1_out, probs, grad, offset)
    want_fc1, want_probs = swiglu_with_probs_backward_eager(fc1_out, probs, grad, offset)
    assert got_fc1.dtype == torch.bfloat16 and got_probs.dtype == torch.float32
    assert got_fc1.shape == want_fc1.shape and got_probs.shape == want_probs.shape
    # Only exp and the row sums' order may differ, in fp32: at most one BF16 unit after rounding.
    torch.testing.assert_close(got_fc1.float(), want_fc1.float(), rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(got_probs, want_probs, rtol=1e-5, atol=1e-4)
    assert (got_fc1.float() != want_fc1.float()).float().mean() < 0.01 if tokens else True


def test_swiglu_backward_kernel_other_dtypes(device, backward_rows_per_program):
    """FP32 gradients and BF16 probs (rounded in the kernel to nearest even, like torch)."""
    fc1_out, probs, grad = _inputs(device, 9, 256, seed=3)
    got_fc1, got_probs = swiglu_with_probs_backward(fc1_out, probs.bfloat16(), grad.float(), 0.5)
    want_fc1, want_probs = swiglu_with_probs_backward_eager(fc1_out, probs.bfloat16(), grad.float(), 0.5)
    assert got_fc1.dtype == torch.float32 and got_probs.dtype == torch.bfloat16
    torch.testing.assert_close(got_fc1, want_fc1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_probs.float(), want_probs.float(), rtol=2**-7, atol=1e-6)


def test_swiglu_backward_refuses_mismatched_shapes(device):
    fc1_out, probs, grad = _inputs(device, 8, 256, seed=1)
    with pytest.raises(ValueError, match="do not match"):
        swiglu_with_probs_backward(fc1_out[:, :256], probs, grad, 0.0)


def _forward_inputs(device, tokens, ffn, seed, dtype=torch.bfloat16):
    """fc1_out with the hard cases in fc1_out and in the SwiGLU's output: a NaN, an all-zero
    MXFP4 block, BF16 subnormals, a 2^20 range inside one 128-group, a zero prob."""
    g = torch.Generator().manual_seed(seed)
    fc1_out = torch.randn(tokens, 2 * ffn, generator=g) * 4
    probs = torch.rand(tokens, generator=g)
    if tokens >= 5:
        fc1_out[0, 5] = float("nan")  # a gate: NaN in both outputs' group
        fc1_out[1, :32] = 0  # a gate block of zeros: a zero output block too
        fc1_out[2, :128] *= torch.exp2(torch.linspace(-10, 10, 128))
        fc1_out[3, ffn:ffn + 64] = 1e-39  # linear: BF16 subnormals
        probs[4] = 0
    return fc1_out.to(dtype).to(device), probs.to(device)


@pytest.mark.parametrize("tokens, ffn, offset, rule", [(37, 256, 0.0, "ceil"), (9, 384, 1.0, "floor"), (70, 128, 0.0, "ceil"),
                                                      (0, 128, 0.0, "ceil")])
def test_swiglu_forward_writes_what_the_quantizers_write_of_its_values(device, tokens, ffn, offset, rule):
    """One pass writes fc2_in's FP8 rows and the MXFP4 rows of fc2_in and fc1_out: the bytes the row
    and MXFP4 quantizers give on the kernel's own values, which are the definition's (eager fp32) up
    to one BF16 unit where exp rounds differently."""
    from megatron_fp4.kernels.swiglu_forward import swiglu_quantized
    from megatron_fp4.kernels import quantize_fp8_rows, quantize_mxfp4

    fc1_out, probs = _forward_inputs(device, tokens, ffn, seed=tokens + ffn)
    both = swiglu_quantized(fc1_out, probs, offset, torch.bfloat16, keep_values=True, mxfp4_rule=rule)
    values = both.values
    want = swiglu_with_probs_eager_values(fc1_out, probs, offset)
    assert values.dtype == torch.bfloat16 and values.shape == (tokens, ffn)
    assert torch.equal(values.isnan(), want.isnan())
    torch.testing.assert_close(values.float(), want.float(), rtol=2**-7, atol=0, equal_nan=True)
    rows = quantize_fp8_rows(values)
    assert torch.equal(both.fp8_rows.data.view(torch.uint8), rows.data.view(torch.uint8))
    assert torch.equal(both.fp8_rows.block_scales.view(torch.int32), rows.block_scales.view(torch.int32))
    assert torch.equal(both.fc2_in_mxfp4.rows, quantize_mxfp4(values, rule).rows)
    assert torch.equal(both.fc1_out_mxfp4.rows, quantize_mxfp4(fc1_out, rule).rows)
    # Each path writes only what it asks for, with the same FP8 rows.
    fp4_path = swiglu_quantized(fc1_out, probs, offset, torch.bfloat16, keep_values=False, mxfp4_rule=rule)
    baseline = swiglu_quantized(fc1_out, probs, offset, torch.bfloat16, keep_values=True, mxfp4_rule=None)
    assert fp4_path.values is None and baseline.fc2_in_mxfp4 is None and baseline.fc1_out_mxfp4 is None
    assert torch.equal(fp4_path.fc1_out_mxfp4.rows, both.fc1_out_mxfp4.rows)
    assert torch.equal(baseline.values.view(torch.int16), values.view(torch.int16))
    for other in (fp4_path, baseline):
        assert torch.equal(other.fp8_rows.data.view(torch.uint8), both.fp8_rows.data.view(torch.uint8))


def swiglu_with_probs_eager_values(fc1_out, probs, offset):
    gate, linear = fc1_out.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * (linear + offset) * probs.float().unsqueeze(-1)).to(fc1_out.dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_swiglu_forward_other_dtypes(device, dtype):
    from megatron_fp4.kernels.swiglu_forward import swiglu_quantized
    from megatron_fp4.kernels import quantize_fp8_rows

    fc1_out, probs = _forward_inputs(device, 11, 256, seed=7, dtype=dtype)
    out = swiglu_quantized(fc1_out, probs, 0.5, dtype, keep_values=True, mxfp4_rule=None)
    want = swiglu_with_probs_eager_values(fc1_out, probs, 0.5)
    assert out.values.dtype == dtype
    torch.testing.assert_close(out.values.float(), want.float(), rtol=2**-10, atol=0, equal_nan=True)
    assert torch.equal(out.fp8_rows.data.view(torch.uint8), quantize_fp8_rows(out.values).data.view(torch.uint8))


def test_swiglu_forward_refuses_bad_input(device):
    from megatron_fp4.kernels.swiglu_forward import swiglu_quantized

    fc1_out, probs = _forward_inputs(device, 4, 128, seed=2)
    with pytest.raises(ValueError, match="multiple of 256"):
        swiglu_quantized(fc1_out[:, :128], probs, 0.0, torch.bfloat16, True, None)
    with pytest.raises(ValueError, match="probs"):
        swiglu_quantized(fc1_out, probs[:3], 0.0, torch.bfloat16, True, None)
    with pytest.raises(ValueError, match="out_dtype"):
        swiglu_quantized(fc1_out, probs, 0.0, torch.int8, True, None)
    with pytest.raises(ValueError, match="scale rule|scale_rule"):
        swiglu_quantized(fc1_out, probs, 0.0, torch.bfloat16, True, "nearest")
