"""The reference against the format definitions (docs/design.md §2-§3), checked by independent float64
arithmetic, plus the exhaustive FP4 -> FP8 conversion table."""

import pytest
import torch

from megatron_fp4 import reference as ref
from megatron_fp4.formats import E2M1_MAGNITUDES, E2M1_MAX, FP4_TO_FP8_EXACT_MAX_GAP, mxfp4_wire_bytes_per_row
from megatron_fp4.tensors import MXFP4Tensor

from support.inputs import hard_input, random_input

GRID = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)


def _blocks(t: torch.Tensor, size: int) -> torch.Tensor:
    return t.reshape(t.shape[0], -1, size)


def _scale(q: MXFP4Tensor) -> torch.Tensor:
    return torch.exp2(q.scales.double() - 127)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scale_rule", ["ceil", "floor"])
def test_quantize_picks_the_rule_scale_and_nearest_even_code(dtype, scale_rule):
    x = hard_input(16, 256, dtype, seed=1)
    q = ref.quantize_mxfp4(x, scale_rule)
    assert q.rows.shape == (16, mxfp4_wire_bytes_per_row(256)) and q.rows.dtype == torch.uint8
    xb = _blocks(x.double(), 32)
    finite = torch.isfinite(xb).all(-1)
    assert torch.equal(q.scales == 255, ~finite)
    amax = xb.abs().amax(-1)
    scale = _scale(q)
    live = finite & (amax > 0)
    if scale_rule == "ceil":
        assert (amax[live] <= E2M1_MAX * scale[live]).all()
        minimal = amax > 3 * scale  # half the scale would have clipped
        assert (minimal | (q.scales == 0))[live].all()
    else:
        expected = (127 + torch.floor(torch.log2(amax[live])) - 2).clamp(0, 254)
        assert torch.equal(q.scales[live].double(), expected)
    assert (q.scales[finite & (amax == 0)] == 0).all()

    codes = ref.unpack_e2m1_codes(q.data)
    v = (x.double().abs() / scale.repeat_interleave(32, 1))
    v = torch.where(finite.repeat_interleave(32, 1), v, 0.0)
    chosen = GRID[codes & 7]
    distances = (v.unsqueeze(-1) - GRID).abs()
    best = distances.min(-1).values
    saturated = v > 6
    assert (((v - chosen).abs() == best) | saturated).all(), "not the nearest E2M1 value"
    tie = (distances == best.unsqueeze(-1)).sum(-1) > 1
    assert ((codes[tie] & 1) == 0).all(), "a tie must round to the even code"
    sign = (codes & 8) != 0
    assert torch.equal(sign[finite.repeat_interleave(32, 1)], torch.signbit(x.float())[finite.repeat_interleave(32, 1)])


def test_ceil_rule_never_clips():
    x = random_input(64, 512, torch.float32, seed=2)
    q = ref.quantize_mxfp4(x, "ceil")
    codes = ref.unpack_e2m1_codes(q.data)
    v = x.double().abs() / _scale(q).repeat_interleave(32, 1)
    assert (v <= E2M1_MAX).all()
    # Every element lands within half a grid step of its value: no clipping anywhere.
    assert ((v - GRID[codes & 7]).abs() <= 1.0).all()


def test_floor_rule_saturates_at_six():
    x = torch.tensor([[7.9] + [0.1] * 31], dtype=torch.float32)  # floor(log2 7.9) = 2: scale 1
    q = ref.quantize_mxfp4(x, "floor")
    assert q.scales.item() == 127 and (q.data[0, 0] & 0xF).item() == 7


@pytest.mark.parametrize("scale_rule", ["ceil", "floor"])
def test_dequantize_then_quantize_is_idempotent(scale_rule):
    x = hard_input(16, 256, torch.bfloat16, seed=3)
    q = ref.quantize_mxfp4(x, scale_rule)
    values = ref.dequantize_mxfp4(q, torch.float32)
    again = ref.quantize_mxfp4(values, scale_rule)
    assert torch.equal(ref.dequantize_mxfp4(again, torch.float32).nan_to_num(7.0), values.nan_to_num(7.0))
    if scale_rule == "floor":
        assert torch.equal(again.rows, q.rows)
    else:
        # Under "ceil" a block whose largest code is 3 (value 3 * 2^s) re-quantizes with scale
        # 2^(s-1) to the same values; every other block comes back byte for byte.
        top = ref.unpack_e2m1_codes(q.data).reshape(16, -1, 32).__and__(7).amax(-1)
        same = top != 5
        assert torch.equal(again.scales[same], q.scales[same])


def test_nan_and_inf_blocks_dequantize_to_nan_and_others_stay_finite():
    x = hard_input(16, 256, torch.bfloat16, seed=4)
    y = ref.dequantize_mxfp4(ref.quantize_mxfp4(x))
    bad_block = ~torch.isfinite(x.float()).reshape(16, -1, 32).all(-1)
    assert torch.equal(torch.isnan(y).reshape(16, -1, 32).all(-1), bad_block)
    assert torch.isfinite(y.reshape(16, -1, 32)[~bad_block]).all()
    assert y.dtype == torch.bfloat16 and y.shape == x.shape


def _one_group(codes_block1: int, gap: int, top_byte: int) -> MXFP4Tensor:
    """One 128-wide group: block 0 holds code 7 at byte top_byte, block 1 holds codes_block1 at
    top_byte - gap, blocks 2-3 are zero blocks (byte 0)."""
    data = torch.zeros(1, 64, dtype=torch.uint8)
    data[0, :16] = 0x77
    data[0, 16:32] = codes_block1 | (codes_block1 << 4)
    scales = torch.tensor([[top_byte, top_byte - gap, 0, 0]], dtype=torch.uint8)
    return MXFP4Tensor.from_parts(data, scales)


def exhaustive_conversion_cases(top_byte: int = 200, max_gap: int = 30) -> MXFP4Tensor:
    """Every E2M1 code (16) at every scale gap 0..max_gap below the group's largest byte."""
    rows = [_one_group(code, gap, top_byte) for gap in range(max_gap + 1) for code in range(16)]
    return MXFP4Tensor(torch.cat([q.rows for q in rows]), 128)


@pytest.mark.parametrize("top_byte", [200, 140, 30])
def test_fp4_to_fp8_rows_exhaustive(top_byte):
    max_gap = min(30, top_byte)
    q = exhaustive_conversion_cases(top_byte, max_gap)
    fp8 = ref.mxfp4_to_fp8_rows(q)
    gaps = torch.arange(max_gap + 1).repeat_interleave(16)
    codes = torch.arange(16).repeat(max_gap + 1)
    block1 = fp8.data[:, 32:64].view(torch.uint8)
    assert (block1 == block1[:, :1]).all()
    byte = block1[:, 0].long()

    # Zero is zero for every gap (keeping the sign of -0).
    zero = (codes & 7) == 0
    assert torch.equal(byte[zero], ((codes[zero] & 8) << 4))
    # Exact where gap <= 14: dequant(FP8) == dequant(FP4) in fp32.
    fp4_values = ref.dequantize_mxfp4(q, torch.float32)[:, 32:64]
    fp8_values = ref.dequantize_fp8(fp8, torch.float32)[:, 32:64]
    exact = gaps <= FP4_TO_FP8_EXACT_MAX_GAP
    assert torch.equal(fp8_values[exact], fp4_values[exact])
    # Beyond: round to nearest even in units of the smallest E4M3 subnormal, 2^-9 * scale.
    units = GRID[codes & 7] * torch.exp2(6.0 - gaps.double()) / 2.0**-9
    rounded = torch.round(units)  # torch.round is half-to-even
    expected_mag = torch.where(exact, units, rounded)
    expected = expected_mag * 2.0**-9 * torch.exp2(torch.tensor(top_byte - 133.0))
    expected = torch.where((codes & 8) != 0, -expected, expected)
    assert torch.equal(fp8_values[:, 0].double(), expected)
    # The largest value is 6 * 2^6 = 384 < 448: never saturates.
    assert fp8.data.float().abs().max().item() == 384.0
    # Zero blocks (2, 3) and the group scale.
    assert (fp8.data[:, 64:].view(torch.uint8) == 0).all()
    assert (fp8.block_scales == 2.0 ** (top_byte - 133)).all()


def test_fp4_to_fp8_cols_matches_rows_transposed_on_aligned_segments():
    x = hard_input(256, 256, torch.bfloat16, seed=5)
    q = ref.quantize_mxfp4(x)
    cols = ref.mxfp4_to_fp8_cols(q, [128, 0, 128])
    assert cols.data.shape == (256, ref.colwise_capacity(256, 3))
    assert cols.segment_offsets.tolist() == [0, 128, 128, 256]
    values = ref.dequantize_fp8(cols, torch.float32)[:, :256].t()
    fp4_values = ref.dequantize_mxfp4(q, torch.float32)
    # Exact wherever no column of a 128-token block spans a scale gap over 14.
    gaps = q.scales.reshape(2, 128, -1).amax(1, keepdim=True) - q.scales.reshape(2, 128, -1)
    exact = ((gaps <= FP4_TO_FP8_EXACT_MAX_GAP) & (q.scales.reshape(2, 128, -1) != 255)).reshape(256, -1).repeat_interleave(32, 1)
    assert torch.equal(values[exact], fp4_values[exact])


def test_fp8_rows_scale_is_minimal_power_of_two():
    x = hard_input(16, 256, torch.bfloat16, seed=6)
    t = ref.quantize_fp8_rows(x)
    assert t.data.dtype == torch.float8_e4m3fn and t.block_scales.shape == (2, 16)
    amax = x.float().reshape(16, 2, 128).abs().amax(-1).t()
    finite = torch.isfinite(amax)
    scale = t.block_scales
    assert torch.isnan(scale[~finite]).all()
    assert (torch.log2(scale[finite]) == torch.round(torch.log2(scale[finite]))).all()
    live = finite & (amax > 2.0**-126 * 448)
    assert (amax[live] <= 448 * scale[live]).all() and (amax[live] > 224 * scale[live]).all()
    y = ref.dequantize_fp8(t, torch.float32)
    scale_per_element = scale.t().repeat_interleave(128, 1)
    normal = finite.t().repeat_interleave(128, 1) & (x.float().abs() >= 2.0**-6 * scale_per_element)
    rel = ((y - x.float()).abs() / x.float().abs())[normal]
    assert rel.max() <= 2.0**-4  # E4M3 normals: 3 mantissa bits, half an ulp is at most 1/16
