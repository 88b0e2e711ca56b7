"""Test inputs and comparisons shared by the test files."""

import torch

from megatron_fp4.tensors import FP8BlockTensor, MXFP4Tensor


def random_input(rows: int, cols: int, dtype: torch.dtype, seed: int, device="cpu") -> torch.Tensor:
    """Normal values times 2^[-8, 8): blocks with very different scales, never all zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-8, 8, (rows, cols), generator=g).float())
    return x.to(dtype).to(device)


def hard_input(rows: int, cols: int, dtype: torch.dtype, seed: int, device="cpu") -> torch.Tensor:
    """random_input with the hard cases planted (needs rows >= 10, cols >= 256):
    an all-zero row, an all-zero block, NaN, +Inf, -Inf, subnormals of the dtype, a 2^20 range
    inside one 128-group, negative zeros, and exact rounding ties of the E2M1 grid."""
    assert rows >= 10 and cols >= 256
    x = random_input(rows, cols, torch.float32, seed)
    x[0] = 0.0
    x[1, 32:64] = 0.0
    x[2, 7] = float("nan")
    x[3, 40] = float("inf")
    x[4, 100] = float("-inf")
    smallest_normal = torch.finfo(dtype).tiny
    x[5, :64] = smallest_normal * torch.linspace(-0.99, 0.99, 64)  # subnormals of the dtype
    x[6, :128] = torch.exp2(torch.linspace(-10, 10, 128)) * torch.where(torch.arange(128) % 3 == 0, -1.0, 1.0)
    x[7, :32] = -0.0
    # Ties: with a block max of 6 the scale is 1, so these sit exactly between two E2M1 values.
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)
    x[8, :32] = ties * torch.where(torch.arange(32) % 2 == 0, 1.0, -1.0)
    x[9, 128:256] = 2.0**20 * torch.linspace(-1, 1, 128)  # large values, inside bf16/fp32 range
    if dtype == torch.float16:
        x[9, 128:256] = 6e4 * torch.linspace(-1, 1, 128)
    return x.to(dtype).to(device)


def column_hard_cases(x: torch.Tensor) -> torch.Tensor:
    """Plant along tokens what hard_input plants along hidden: a 2^20 range, subnormals and zeros
    inside one 128-token block of one column (the cols quantizer's groups run along tokens)."""
    tokens = min(128, x.shape[0])
    x[:tokens, 3] = (torch.exp2(torch.linspace(-10, 10, tokens)) * torch.where(torch.arange(tokens) % 3 == 0, -1.0, 1.0)).to(x.dtype)
    x[:tokens, 5] = (torch.finfo(x.dtype).tiny * torch.linspace(-0.99, 0.99, tokens)).to(x.dtype)
    x[:tokens, 9] = 0.0
    return x


def every_code_at_every_gap(top_byte: int, max_gap: int) -> MXFP4Tensor:
    """One 128-wide group per (gap, sign), gap 0..max_gap: block 0 holds code 7 at byte top_byte,
    block 1 the eight E2M1 codes of that sign (four times each) at top_byte - gap, blocks 2-3 are
    zero blocks (byte 0). Every code meets every gap, each row a single gap and sign."""
    rows = []
    for gap in range(max_gap + 1):
        for sign in (0, 8):
            codes = torch.arange(sign, sign + 8, dtype=torch.uint8).repeat_interleave(2)  # 16 bytes
            data = torch.zeros(64, dtype=torch.uint8)
            data[:16] = 0x77
            data[16:32] = codes | (codes << 4)
            rows.append((data, torch.tensor([top_byte, top_byte - gap, 0, 0], dtype=torch.uint8)))
    return MXFP4Tensor.from_parts(torch.stack([d for d, _ in rows]), torch.stack([s for _, s in rows]))


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-for-bit equality, except that any NaN equals any NaN (payloads may differ)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    a, e = actual.cpu(), expected.cpu()
    a_nan, e_nan = _isnan(a), _isnan(e)
    assert torch.equal(a_nan, e_nan), f"NaN at different places: {(a_nan != e_nan).sum().item()} elements"
    bits_a, bits_e = _bits(a)[~a_nan], _bits(e)[~e_nan]
    mismatch = bits_a != bits_e
    assert not mismatch.any(), (
        f"{mismatch.sum().item()} of {bits_a.numel()} elements differ; first: "
        f"{bits_a[mismatch][:4].tolist()} vs {bits_e[mismatch][:4].tolist()}"
    )


def _isnan(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.float8_e4m3fn:
        return (t.view(torch.uint8) & 0x7F) == 0x7F
    if t.is_floating_point():
        return torch.isnan(t)
    return torch.zeros_like(t, dtype=torch.bool)


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def assert_same_mxfp4(actual: MXFP4Tensor, expected: MXFP4Tensor) -> None:
    assert actual.shape == expected.shape and actual.scale_rule == expected.scale_rule
    assert_same_bits(actual.scales, expected.scales)
    assert_same_bits(actual.data, expected.data)


def assert_same_fp8(actual: FP8BlockTensor, expected: FP8BlockTensor) -> None:
    assert actual.layout == expected.layout
    assert_same_bits(actual.data, expected.data)
    assert_same_bits(actual.block_scales, expected.block_scales)
    if expected.segment_offsets is not None:
        assert torch.equal(actual.segment_offsets.cpu(), expected.segment_offsets.cpu())
