"""The experts' SwiGLU backward kernel against its definition in torch ops (eager, fp32)."""

import pytest
import torch

from megatron_fp4.experts.swiglu import swiglu_with_probs_backward, swiglu_with_probs_backward_eager


def _inputs(device, tokens, ffn, seed):
    g = torch.Generator().manual_seed(seed)
    fc1_out = (torch.randn(tokens, 2 * ffn, generator=g) * 4).bfloat16()
    fc1_out[:1, :3] = torch.tensor([0.0, -80.0, 80.0])  # zero and saturated gates
    probs = torch.rand(tokens, generator=g)
    grad = torch.randn(tokens, ffn, generator=g).bfloat16()
    return fc1_out.to(device), probs.to(device), grad.to(device)


@pytest.mark.parametrize("tokens, ffn, offset", [(37, 384, 0.0), (5, 2048, 1.0), (0, 256, 0.0)])
def test_swiglu_backward_kernel_matches_its_definition(device, tokens, ffn, offset):
    fc1_out, probs, grad = _inputs(device, tokens, ffn, seed=tokens + ffn)
    got_fc1, got_probs = swiglu_with_probs_backward(fc1_out, probs, grad, offset)
    want_fc1, want_probs = swiglu_with_probs_backward_eager(fc1_out, probs, grad, offset)
    assert got_fc1.dtype == torch.bfloat16 and got_probs.dtype == torch.float32
    assert got_fc1.shape == want_fc1.shape and got_probs.shape == want_probs.shape
    # Only exp and the row sums' order may differ, in fp32: at most one BF16 unit after rounding.
    torch.testing.assert_close(got_fc1.float(), want_fc1.float(), rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(got_probs, want_probs, rtol=1e-5, atol=1e-4)
    assert (got_fc1.float() != want_fc1.float()).float().mean() < 0.01 if tokens else True


def test_swiglu_backward_kernel_other_dtypes(device):
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
