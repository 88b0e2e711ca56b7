"""FP8 128x128 weight quantization (the expert weights' format): the Triton kernel against the
reference bit for bit, plain and transposed, with the hard cases inside single blocks."""

import pytest
import torch

import megatron_fp4 as mf
from megatron_fp4 import reference as ref

from support.inputs import assert_same_bits, hard_input, random_input

FLOAT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def assert_same_weight(actual: mf.FP8BlockWeight, expected: mf.FP8BlockWeight) -> None:
    assert_same_bits(actual.data, expected.data)
    assert_same_bits(actual.block_scales, expected.block_scales)


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_quantize_fp8_weight_hard_cases(device, dtype, transpose):
    # 384 x 640: 3 x 5 blocks, so the scale columns are padded (5 -> 8, or 3 -> 4 transposed).
    w = hard_input(384, 640, dtype, seed=31, device=device)
    w[256:384, 256:384] = 0.0  # one all-zero block
    got = mf.quantize_fp8_weight(w, transpose=transpose)
    expected = ref.quantize_fp8_weight(w, transpose=transpose)
    assert_same_weight(got, expected)
    # Blocks with NaN / Inf planted by hard_input are NaN; the zero block has the smallest scale.
    scales = expected.scales() if not transpose else expected.scales().t()
    assert torch.isnan(scales[0, 0])
    assert scales[2, 2] == 2.0**-126
    assert torch.isfinite(scales[1:]).all() and torch.isfinite(scales[0, 1:]).all()


@pytest.mark.parametrize("seed", [1, 2])
def test_quantize_fp8_weight_fresh_random(device, seed):
    w = random_input(256, 512, torch.bfloat16, seed=40 + seed, device=device) * 0.02
    plain = mf.quantize_fp8_weight(w)
    assert_same_weight(plain, ref.quantize_fp8_weight(w))
    # The transposed quantization is the same blocks transposed, and the padding is 1.0.
    transposed = mf.quantize_fp8_weight(w, transpose=True)
    assert_same_bits(transposed.data, plain.data.t().contiguous())
    assert_same_bits(transposed.scales(), plain.scales().t().contiguous())
    assert (plain.block_scales[:, 4:] == 1.0).all() and (transposed.block_scales[:, 2:] == 1.0).all()
    # Each value within half an E4M3 unit of the weight (2^-4 relative, 2^-10 x scale absolute).
    scale = plain.scales().repeat_interleave(128, 0).repeat_interleave(128, 1)
    error = (ref.dequantize_fp8_weight(plain) - w.float()).abs()
    assert (error <= w.float().abs() * 2**-4 + scale * 2**-10).all()


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_fp8_weights_in_one_launch(device, dtype, transpose):
    """Several separate weights (the experts of one linear) read through their address table: each
    result bit-identical to its own reference, hard cases in one of them."""
    weights = [random_input(256, 384, dtype, seed=50 + i, device=device) * 2.0**(3 * i - 6) for i in range(3)]
    weights[1] = hard_input(256, 384, dtype, seed=57, device=device)
    weights[2][:128, 128:256] = 0.0
    got = mf.quantize_fp8_weights(weights, transpose=transpose)
    assert len(got) == 3
    for w, quantized in zip(weights, got):
        assert_same_weight(quantized, ref.quantize_fp8_weight(w, transpose=transpose))
    # The same tensors again (a cached address table), after changing their values in place.
    for w in weights:
        w.mul_(-0.5)
    for w, quantized in zip(weights, mf.quantize_fp8_weights(weights, transpose=transpose)):
        assert_same_weight(quantized, ref.quantize_fp8_weight(w, transpose=transpose))


@pytest.mark.parametrize("dtype,elements", [(torch.bfloat16, 1), (torch.bfloat16, 2), (torch.float32, 1),
                                            (torch.float32, 2)], ids=["bf16+1", "bf16+2", "fp32+1", "fp32+2"])
def test_quantize_fp8_weights_at_a_storage_offset(device, dtype, elements):
    """Weights that start inside their buffer (an odd element, or 4 / 8 bytes: not the 16 the kernel's
    vector loads need) are copied first and quantize as the reference does, alone and stacked with an
    aligned one."""
    seed = int(torch.randint(1000, (1,)))
    aligned = random_input(128, 256, dtype, seed=seed, device=device) * 0.02
    buffer = random_input(129, 256, dtype, seed=seed + 1, device=device).reshape(-1)
    inside = buffer[elements:elements + 128 * 256].view(128, 256)
    assert inside.storage_offset() == elements
    assert_same_weight(mf.quantize_fp8_weight(inside, transpose=True), ref.quantize_fp8_weight(inside, transpose=True))
    for w, quantized in zip((aligned, inside), mf.quantize_fp8_weights([aligned, inside])):
        assert_same_weight(quantized, ref.quantize_fp8_weight(w))


def test_quantize_fp8_weights_refuses_mixed_weights(device):
    w = torch.zeros(128, 256, device=device)
    with pytest.raises(ValueError, match="no weights"):
        mf.quantize_fp8_weights([])
    with pytest.raises(ValueError, match="like the first"):
        mf.quantize_fp8_weights([w, torch.zeros(256, 256, device=device)])
    with pytest.raises(ValueError, match="like the first"):
        mf.quantize_fp8_weights([w, w.bfloat16()])
    with pytest.raises(ValueError, match="like the first"):
        mf.quantize_fp8_weights([w, torch.zeros(256, 128, device=device).t()])


def test_quantize_fp8_weight_refuses_bad_shapes(device):
    with pytest.raises(ValueError, match="multiple of 128"):
        mf.quantize_fp8_weight(torch.zeros(100, 256, device=device))
    with pytest.raises(ValueError, match="multiple of 128"):
        mf.quantize_fp8_weight(torch.zeros(128, 200, device=device))


def test_transposed_stacked_weights_equal_quantizing_the_transpose(device):
    """W^T by moving the cached W's bytes (the experts' data gradient operand) is bit for bit the
    transposed quantization, hard cases (NaN and Inf blocks, a zero block, subnormals) included;
    3 x 5 blocks, so both scale paddings differ."""
    weights = [random_input(384, 640, torch.bfloat16, seed=70 + i, device=device) for i in range(2)]
    weights.append(hard_input(384, 640, torch.bfloat16, seed=73, device=device))
    weights[0][128:256, 256:384] = 0.0
    plain = mf.kernels.quantize_fp8_weights_stacked(weights)
    transposed = mf.kernels.transpose_fp8_weights(plain)
    expected = mf.kernels.quantize_fp8_weights_stacked(weights, transpose=True)
    assert_same_bits(transposed.data, expected.data)
    assert_same_bits(transposed.block_scales, expected.block_scales)
    with pytest.raises(TypeError, match="FP8StackedWeights"):
        mf.kernels.transpose_fp8_weights(plain[0])
