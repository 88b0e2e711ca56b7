"""The forward GEMM that reads MXFP4 rows itself (grouped_gemm_by_weight_from_mxfp4, CUDA on SM90)
gives the bits of converting them first (mxfp4_to_fp8_rows) and multiplying the FP8 copy
(grouped_gemm_by_weight): at every stage count and tile width, on ragged segments with empty and
one-token experts, NaN blocks, all-zero blocks, BF16 subnormals, 2^20 of range inside a 128-group,
and every E2M1 code at every scale gap a pair of E8M0 bytes can make."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatron_fp4 import kernels as K
from megatron_fp4 import reference as ref
from megatron_fp4.formats import E8M0_MAX_FINITE, E8M0_NAN
from megatron_fp4.kernels.grouped_fp8_gemm import CUDA_ROWS_TILES, CUDA_TILES, DEFAULT_ROWS_TILES
from megatron_fp4.tensors import MXFP4Tensor

COUNTS = [700, 0, 1, 3, 129, 2048, 64, 1000]


def _offsets(counts, device) -> torch.Tensor:
    return F.pad(torch.tensor(counts).cumsum(0), (1, 0)).to(device)


def _weights(experts: int, n: int, k: int, device, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(experts, n, k, generator=g) * torch.exp2(torch.randint(-4, 4, (experts, n, 1), generator=g).float())
    return K.quantize_fp8_weights_stacked(list((w * 0.02).bfloat16().to(device)))


def _hard_rows(m: int, k: int, device, seed: int) -> MXFP4Tensor:
    """MXFP4 rows of 2^20 of range inside each 128-group, with a NaN row, a row holding one NaN block
    among finite ones, an all-zero row, a row of BF16 subnormals and a row of zero blocks next to large
    ones."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-10, 10, (m, k), generator=g).float())
    if m > 9:
        x[5] = float("nan")
        x[6] = 0.0
        x[7, 40] = float("inf")  # block 1 of the first group: NaN, blocks 0, 2, 3 keep their values
        x[8] = torch.randn(k, generator=g) * 2.0**-130  # BF16 subnormals
        x[9, :32] = 0.0
        x[9, 32:64] *= 2.0**12
    return K.quantize_mxfp4(x.bfloat16().to(device))


def _mxfp4_tiles():
    """Every stage count of the MXFP4 kernel at both tile widths, in the default row-tile groups; and
    the first in groups of 1 and 8."""
    from megatron_fp4.kernels import grouped_gemm_sm90 as sm90

    tiles = [dataclasses.replace(CUDA_ROWS_TILES, num_stages=stages, block_n=block_n) for block_n in sm90.BLOCK_NS
             for stages in sm90.ROWS_MXFP4.stage_counts(block_n)]
    return tiles + [dataclasses.replace(tiles[0], group_m=group_m) for group_m in (1, 8)]


def test_the_stage_counts_fit_the_shared_memory():
    from megatron_fp4.kernels import grouped_gemm_sm90 as sm90

    assert list(sm90.ROWS_MXFP4.stage_counts(128)) == [2, 3, 4] and list(sm90.ROWS_MXFP4.stage_counts(256)) == [2]


def test_the_magnitude_table_is_the_reference_conversion():
    """Row d of the kernel's table: the E4M3 bytes of the E2M1 magnitudes times 2^(6 - d), exact while
    d <= 14 (DESIGN §4), rounded to nearest even beyond, zero at the end: the reference's conversion of
    every code at every gap."""
    from megatron_fp4.kernels._e4m3_table import e4m3_magnitude_table

    table = e4m3_magnitude_table()
    assert torch.equal(table, ref.fp4_to_fp8_magnitude_table())
    assert table.shape == (256, 8) and table.dtype == torch.uint8
    magnitudes = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)
    values = table.view(torch.float8_e4m3fn).double()
    for d in range(15):
        assert torch.equal(values[d], magnitudes * 2.0 ** (6 - d)), d
    assert values[15].tolist() == [0, 0, 2.0**-9, 2 * 2.0**-9, 2 * 2.0**-9, 3 * 2.0**-9, 4 * 2.0**-9, 6 * 2.0**-9]
    assert not table[20:].any() and not table[:, 0].any()


def test_refusals(device):
    """Each refused with its reason before anything runs: not MXFP4, Triton tiles (the Triton kernels
    have no MXFP4 path), changed CUDA tiles, K not a multiple of 512 or rows TMA cannot copy, K that
    differs from the weights', and off an SM90 GPU."""
    rows = _hard_rows(16, 512, device, seed=1)
    weights = _weights(2, 256, 512, device, seed=2)
    offsets = _offsets([10, 6], device)
    with pytest.raises(TypeError, match="expected an MXFP4Tensor"):
        K.grouped_gemm_by_weight_from_mxfp4(K.mxfp4_to_fp8_rows(rows), weights, offsets)
    with pytest.raises(ValueError, match="only the CUDA kernel"):
        K.grouped_gemm_by_weight_from_mxfp4(rows, weights, offsets, tiles=DEFAULT_ROWS_TILES)
    narrow = _hard_rows(16, 256, device, seed=3)  # 8 scale bytes a row
    with pytest.raises(ValueError, match="K must be a multiple of 512"):
        K.grouped_gemm_by_weight_from_mxfp4(narrow, _weights(2, 256, 256, device, seed=4), offsets, tiles=CUDA_TILES)
    padded = torch.zeros(16, rows.rows.shape[1] + 8, dtype=torch.uint8, device=device)
    padded[:, :rows.rows.shape[1]] = rows.rows  # rows of 272 bytes, 280 apart
    with pytest.raises(ValueError, match="row stride of whole 16 bytes"):
        K.grouped_gemm_by_weight_from_mxfp4(MXFP4Tensor(padded[:, :rows.rows.shape[1]], 512), weights, offsets,
                                            tiles=CUDA_TILES)
    with pytest.raises(ValueError, match="CUDA kernel takes"):
        K.grouped_gemm_by_weight_from_mxfp4(rows, weights, offsets, tiles=dataclasses.replace(CUDA_TILES, block_m=64))
    with pytest.raises(ValueError, match="the weights 1024"):
        K.grouped_gemm_by_weight_from_mxfp4(rows, _weights(2, 256, 1024, device, seed=5), offsets, tiles=CUDA_TILES)
    with pytest.raises(ValueError, match="2 to 4 stages at block_n 128"):
        K.grouped_gemm_by_weight_from_mxfp4(rows, weights, offsets, tiles=dataclasses.replace(CUDA_TILES, num_stages=5))
    with pytest.raises(ValueError, match="group_m 1 to 64"):
        K.grouped_gemm_by_weight_from_mxfp4(rows, weights, offsets, tiles=dataclasses.replace(CUDA_TILES, group_m=0))
    if device.type == "cpu":
        with pytest.raises(RuntimeError, match="needs a GPU"):
            K.grouped_gemm_by_weight_from_mxfp4(rows, weights, offsets, tiles=CUDA_TILES)


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("counts,k,n", [(COUNTS, 7168, 4096), ([1, 0, 260], 512, 256), ([0, 5, 0], 512, 256),
                                        (torch.randint(0, 40, (70,), generator=torch.Generator().manual_seed(6)).tolist(),
                                         1024, 256)],
                         ids=["fc1", "small", "one_row_tile", "seventy_experts"])
def test_reading_mxfp4_gives_the_bits_of_the_fp8_copy(counts, k, n, out_dtype):
    rows = _hard_rows(sum(counts), k, "cuda", seed=7)
    weights = _weights(len(counts), n, k, "cuda", seed=8)
    offsets = _offsets(counts, "cuda")
    expected = K.grouped_gemm_by_weight(K.mxfp4_to_fp8_rows(rows), weights, offsets, out_dtype, tiles=DEFAULT_ROWS_TILES)
    bits = torch.int16 if out_dtype == torch.bfloat16 else torch.int32
    for tiles in _mxfp4_tiles():
        if n % tiles.block_n == 0:
            ours = K.grouped_gemm_by_weight_from_mxfp4(rows, weights, offsets, out_dtype, tiles=tiles)
            assert torch.equal(ours.view(bits), expected.view(bits)), str(tiles)
    if sum(counts) > 9:
        assert torch.isnan(expected[5]).all() and torch.isnan(expected[7]).all() and not torch.isnan(expected[8:]).any()


def _every_code_at_every_gap(k: int, device) -> MXFP4Tensor:
    """Rows whose 128-groups hold a block at the group's largest scale byte S (codes of magnitude <= 1)
    and three blocks at gaps d = S - e, every d of 0 .. 254 once, with all 16 codes twice each; S is 130
    where the group's gaps allow it and 254 beyond, so that no output overflows fp32 (with S = 254
    small gaps would, and an inf hides a wrong byte). Then rows with NaN blocks at each block position."""
    blocks_per_row = k // 32
    gap_slots = [b for b in range(blocks_per_row) if b % 4]  # three per group
    gaps = list(range(E8M0_MAX_FINITE + 1))
    num_rows = -(-len(gaps) // len(gap_slots))
    low_s = 130  # 2^(130 - 133) scales the largest E4M3 value, 384, to 48
    scales = torch.full((num_rows + 4, blocks_per_row), low_s, dtype=torch.uint8)
    codes = torch.arange(16, dtype=torch.uint8).repeat(2).repeat(num_rows + 4, blocks_per_row)
    small = torch.tensor([0, 1, 2, 8, 9, 10], dtype=torch.uint8)  # +-0, +-0.5, +-1
    for b in range(0, blocks_per_row, 4):
        codes[:, 32 * b:32 * (b + 1)] = small[torch.arange(32) % 6]
    for group_start in range(0, len(gaps), 3):
        group_gaps = gaps[group_start:group_start + 3]
        largest = low_s if max(group_gaps) <= low_s else E8M0_MAX_FINITE
        row, slot = divmod(group_start, len(gap_slots))
        scales[row, gap_slots[slot] - 1] = largest  # the group's S block precedes its three gap slots
        for i, d in enumerate(group_gaps):
            scales[row, gap_slots[slot + i]] = largest - d
    for b in range(4):  # NaN blocks: the group's S comes from the others
        scales[num_rows + b, b::4] = E8M0_NAN
    data = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(device)
    return MXFP4Tensor.from_parts(data, scales.to(device))


@pytest.mark.gpu
def test_every_code_at_every_gap_through_identity_weights():
    """With W = I, fp32 output y[r, j] is element (r, j) of X as converted times its scales: one element
    per output, so every E2M1 code at every gap must convert to the FP8 copy's bits. (A NaN element
    spreads over its row, NaN x 0 being NaN: the NaN rows check that NaN blocks stay NaN, not where.)"""
    k = 512
    rows = _every_code_at_every_gap(k, "cuda")
    identity = K.quantize_fp8_weights_stacked([torch.eye(k, dtype=torch.bfloat16, device="cuda")])
    offsets = _offsets([rows.num_tokens], "cuda")
    fp8_copy = K.mxfp4_to_fp8_rows(rows)
    expected = K.grouped_gemm_by_weight(fp8_copy, identity, offsets, torch.float32, tiles=CUDA_TILES)
    finite_rows = rows.num_tokens - 4
    reference = ref.mxfp4_to_fp8_rows(MXFP4Tensor(rows.rows.cpu(), k))
    dequantized = reference.data.float() * reference.block_scales.t().repeat_interleave(128, dim=1)
    # The identity keeps every element: the GEMM's output is the reference's conversion, all finite.
    assert torch.equal(expected[:finite_rows].cpu(), dequantized[:finite_rows])
    assert torch.isfinite(dequantized[:finite_rows]).all()
    for tiles in _mxfp4_tiles():
        if k % tiles.block_n == 0:
            ours = K.grouped_gemm_by_weight_from_mxfp4(rows, identity, offsets, torch.float32, tiles=tiles)
            assert torch.equal(ours.view(torch.int32), expected.view(torch.int32)), str(tiles)
    assert torch.isnan(expected[finite_rows:]).all()
