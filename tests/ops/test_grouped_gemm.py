"""The grouped FP8 GEMMs (megatron_fp4.kernels.grouped_fp8_gemm, both backends) against a float64 oracle of the
same FP8 operands and against one scaled_mm per expert, on ragged segments: an empty expert, a
single token, lengths that are not multiples of 4 or of 128, a segment longer than a tile.

The bound, for an output y = sum over K blocks b of s_a,b s_w,b sum_k a_k w_k (s: power-of-two
scales, a_k w_k: products of E4M3 values, exact in fp32): with D = sum_k |s_a a_k| |s_w w_k|, a
result accumulated in fp32 in any order is within eps * D of the exact sum, eps = K * 2^-24 for a
sequential fp32 sum (the interpreter), and the tensor cores' FP8 accumulation keeps fewer bits
inside a block (eps_gpu below, measured and printed). Rounding to BF16 (to nearest even) adds at most
2^-8 |y|. Two results of the same operands (ours and scaled_mm's) are therefore within
2 eps D + 2^-8 (|y1| + |y2|) of each other; against the float64 oracle, eps D + 2^-8 |y|.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatron_fp4 import kernels as K
from megatron_fp4.kernels import GemmBackend, GemmTiles
from megatron_fp4.kernels.grouped_gemm_sm90 import CUDA_ROWS_TILES, CUDA_TILES, CUDA_WIDE_TILES
from megatron_fp4.kernels.grouped_gemm_triton import DEFAULT_ROWS_TILES, DEFAULT_WGRAD_TILES
from megatron_fp4.tensors import COLWISE, FP8BlockTensor

TRITON, CUDA = GemmBackend.TRITON, GemmBackend.CUDA_SM90

COUNTS = [130, 0, 3, 1, 70, 0, 256]  # > a tile, empty, not a multiple of 4, one token, ..., two full tiles
TILES_NOT_A_BACKEND = GemmTiles(block_m=64, block_n=128, num_warps=4, num_stages=2)
SMALL_TILES = GemmTiles(block_m=128, block_n=128, num_warps=4, num_stages=2, row_halves=2)
TMA_TILES = GemmTiles(block_m=128, block_n=128, num_warps=4, num_stages=2, row_halves=2, tma=True)
BF16_ROUNDING = 2.0**-8  # half a unit of the 8-bit significand
# Measured on H200 against scaled_mm (the test prints the worst seen): FP8 tensor-core sums keep
# about 14 bits inside a 128-block.
EPS_GPU = 2.0**-10


def _eps(device: torch.device, k: int) -> float:
    return EPS_GPU if device.type == "cuda" else k * 2.0**-24


def _rows_operand(m: int, k: int, device, seed: int):
    g = torch.Generator().manual_seed(seed)
    # Values over 2^20 of range inside each 128-group, so the 1x128 scales matter.
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-10, 10, (m, k), generator=g).float())
    return K.quantize_fp8_rows(x.bfloat16().to(device))


def _weights(experts: int, n: int, k: int, device, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(experts, n, k, generator=g) * torch.exp2(torch.randint(-4, 4, (experts, n, 1), generator=g).float())
    return K.quantize_fp8_weights_stacked(list((w * 0.02).bfloat16().to(device)))


def _dequantized_rows(t: FP8BlockTensor) -> torch.Tensor:
    return t.data.double().cpu() * t.block_scales.t().double().cpu().repeat_interleave(128, dim=1)


def _dequantized_weight(weight) -> torch.Tensor:
    scales = weight.scales().double().cpu().repeat_interleave(128, 0).repeat_interleave(128, 1)
    return weight.data.double().cpu() * scales


def _offsets(counts, device) -> torch.Tensor:
    return F.pad(torch.tensor(counts).cumsum(0), (1, 0)).to(device)


def _oracle_rows(rows, weights, counts):
    """Per expert in float64: (exact product, D = the product of absolute values)."""
    x = _dequantized_rows(rows)
    exact = torch.zeros(x.shape[0], weights.data.shape[1], dtype=torch.float64)
    magnitude = torch.zeros_like(exact)
    start = 0
    for e, n in enumerate(counts):
        w = _dequantized_weight(weights[e])
        exact[start:start + n] = x[start:start + n] @ w.t()
        magnitude[start:start + n] = x[start:start + n].abs() @ w.t().abs()
        start += n
    return exact, magnitude


def _assert_within(result, exact, magnitude, eps, rounding):
    result = result.double().cpu()
    excess = (result - exact).abs() - (eps * magnitude + rounding * result.abs())
    assert excess.max() <= 0, f"worst excess over the bound {excess.max():.3e}"


@pytest.mark.parametrize("backend,tiles", [(None, None), (TRITON, SMALL_TILES), (TRITON, TMA_TILES),
                                           pytest.param(CUDA, CUDA_TILES, marks=pytest.mark.gpu)],
                         ids=["default", "two-row-halves", "tma", "cuda_sm90"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_grouped_gemm_matches_the_float64_oracle(device, backend, tiles, out_dtype):
    k, n = 384, 256  # non-square, three K blocks
    rows = _rows_operand(sum(COUNTS), k, device, seed=1)
    weights = _weights(len(COUNTS), n, k, device, seed=2)
    y = K.grouped_gemm_by_weight(rows, weights, _offsets(COUNTS, device), out_dtype, tiles=tiles, backend=backend)
    assert y.shape == (sum(COUNTS), n) and y.dtype == out_dtype
    exact, magnitude = _oracle_rows(rows, weights, COUNTS)
    rounding = BF16_ROUNDING if out_dtype == torch.bfloat16 else 2.0**-24
    _assert_within(y, exact, magnitude, _eps(device, k), rounding)


def test_grouped_gemm_propagates_nan_only_to_its_rows(device):
    k, n, counts = 256, 128, [5, 0, 7]
    x = torch.randn(sum(counts), k)
    x[6, 200] = float("nan")  # expert 2's first row, second K block
    rows = K.quantize_fp8_rows(x.bfloat16().to(device))
    y = K.grouped_gemm_by_weight(rows, _weights(3, n, k, device, seed=3), _offsets(counts, device)).cpu()
    assert torch.isnan(y[6]).all()
    assert torch.isfinite(torch.cat([y[:6], y[7:]])).all()


def test_grouped_gemm_without_rows(device):
    rows = _rows_operand(0, 128, device, seed=4)
    y = K.grouped_gemm_by_weight(rows, _weights(2, 128, 128, device, seed=5), _offsets([0, 0], device))
    assert y.shape == (0, 128)


def _cols_operands(counts, n, k, device, seed, nan_token=None):
    """dY^T and X^T of ragged segments; nan_token: that token's X holds a NaN in column 3 (so its
    expert's weight gradient has a NaN column)."""
    g = torch.Generator().manual_seed(seed)
    m = sum(counts)
    grad = (torch.randn(m, n, generator=g) * torch.exp2(torch.randint(-8, 8, (m, 1), generator=g).float())).bfloat16()
    x = (torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-8, 8, (m, k), generator=g).float())).bfloat16()
    if nan_token is not None:
        x[nan_token, 3] = float("nan")
    counts_device = torch.tensor(counts).to(device)
    return K.quantize_fp8_cols(grad.to(device), counts_device), K.quantize_fp8_cols(x.to(device), counts_device)


def _oracle_wgrad(grad_cols, x_cols):
    grad, x = _dequantized_rows(grad_cols), _dequantized_rows(x_cols)
    offsets = grad_cols.segment_offsets.tolist()
    pairs = [(grad[:, a:b] @ x[:, a:b].t(), grad[:, a:b].abs() @ x[:, a:b].abs().t())
             for a, b in zip(offsets, offsets[1:])]
    return torch.stack([p for p, _ in pairs]), torch.stack([m for _, m in pairs])


@pytest.mark.parametrize("backend,tiles", [(None, None), (TRITON, SMALL_TILES), (TRITON, TMA_TILES),
                                           pytest.param(CUDA, CUDA_TILES, marks=pytest.mark.gpu)],
                         ids=["default", "two-row-halves", "tma", "cuda_sm90"])
def test_grouped_wgrad_matches_the_float64_oracle(device, backend, tiles):
    n, k = 256, 384
    grad_cols, x_cols = _cols_operands(COUNTS, n, k, device, seed=6)
    dw = K.grouped_wgrad(grad_cols, x_cols, tiles=tiles, backend=backend)
    assert dw.shape == (len(COUNTS), n, k) and dw.dtype == torch.bfloat16
    exact, magnitude = _oracle_wgrad(grad_cols, x_cols)
    tokens = int(grad_cols.segment_offsets[-1])
    _assert_within(dw, exact, magnitude, _eps(device, tokens), BF16_ROUNDING)
    for e, count in enumerate(COUNTS):
        if not count:
            assert not dw[e].any(), f"expert {e} had no tokens: its gradient must be zero"


def test_grouped_wgrad_accumulates_fp32_into_buffers(device):
    n, k = 128, 256
    grad_cols, x_cols = _cols_operands(COUNTS, n, k, device, seed=7)
    expected = K.grouped_wgrad(grad_cols, x_cols, torch.float32)
    buffers = [torch.full((n, k), 0.5, device=device) for _ in COUNTS]
    assert K.grouped_wgrad(grad_cols, x_cols, accumulate_into=buffers) is None
    for e, buffer in enumerate(buffers):
        assert torch.equal(buffer, expected[e] + 0.5), e
    with pytest.raises(ValueError, match="accumulation buffers"):
        K.grouped_wgrad(grad_cols, x_cols, accumulate_into=buffers[:-1])
    with pytest.raises(ValueError, match="contiguous fp32"):
        K.grouped_wgrad(grad_cols, x_cols, accumulate_into=[b.bfloat16() for b in buffers])


@pytest.mark.parametrize("halves", [1, 2])
def test_tma_and_pointer_loads_give_the_same_bits(device, halves):
    """The two ways of loading operand tiles feed the same products: on the GPU a check of the TMA
    descriptors and their zero fill past the last row (the interpreter emulates both)."""
    pointer = GemmTiles(block_m=64 * halves, block_n=128, num_warps=4, num_stages=2, row_halves=halves)
    tma = GemmTiles(block_m=64 * halves, block_n=128, num_warps=4, num_stages=2, row_halves=halves, tma=True)
    rows, weights = _rows_operand(sum(COUNTS), 256, device, seed=14), _weights(len(COUNTS), 128, 256, device, seed=15)
    offsets = _offsets(COUNTS, device)
    assert torch.equal(K.grouped_gemm_by_weight(rows, weights, offsets, tiles=tma, backend=TRITON),
                       K.grouped_gemm_by_weight(rows, weights, offsets, tiles=pointer, backend=TRITON))
    grad_cols, x_cols = _cols_operands(COUNTS, 128, 256, device, seed=16)
    assert torch.equal(K.grouped_wgrad(grad_cols, x_cols, torch.float32, tiles=tma, backend=TRITON),
                       K.grouped_wgrad(grad_cols, x_cols, torch.float32, tiles=pointer, backend=TRITON))


def test_grouped_wgrad_without_tokens(device):
    """Operands of no token columns at all (one expert without tokens): zero gradients."""
    offsets = torch.zeros(2, dtype=torch.int64, device=device)
    grad_cols, x_cols = (FP8BlockTensor(torch.empty(rows, 0, dtype=torch.float8_e4m3fn, device=device),
                                        torch.empty(0, rows, device=device), COLWISE, offsets) for rows in (128, 256))
    assert torch.equal(K.grouped_wgrad(grad_cols, x_cols), torch.zeros(1, 128, 256, dtype=torch.bfloat16, device=device))
    buffers = [torch.full((128, 256), 0.5, device=device)]
    assert K.grouped_wgrad(grad_cols, x_cols, accumulate_into=buffers) is None
    assert torch.equal(buffers[0], torch.full_like(buffers[0], 0.5))


def test_refusals(device):
    rows = _rows_operand(8, 256, device, seed=8)
    weights = _weights(2, 128, 256, device, seed=9)
    with pytest.raises(ValueError, match="row_offsets must be int64 \\[3\\]"):
        K.grouped_gemm_by_weight(rows, weights, _offsets([4, 4], device).int())
    with pytest.raises(ValueError, match="K = 128"):
        K.grouped_gemm_by_weight(_rows_operand(8, 128, device, seed=10), weights, _offsets([4, 4], device))
    with pytest.raises(TypeError, match="FP8StackedWeights"):
        K.grouped_gemm_by_weight(rows, weights[0], _offsets([4, 4], device))
    grad_cols, x_cols = _cols_operands([4, 4], 128, 256, device, seed=11)
    with pytest.raises(TypeError, match="colwise"):
        K.grouped_wgrad(rows, x_cols)
    # The first 128 token columns (offsets that fit them), not contiguous.
    sliced = FP8BlockTensor(x_cols.data[:, :128], x_cols.block_scales[:1], x_cols.layout,
                            torch.tensor([0, 128, 128], device=device))
    for tma in (False, True):  # both read a matrix whose row stride is its width
        tiles = GemmTiles(block_m=64, block_n=128, num_warps=4, num_stages=2, tma=tma)
        with pytest.raises(ValueError, match="must be contiguous"):
            K.grouped_wgrad(sliced, sliced, tiles=tiles, backend=TRITON)
    offsets = _offsets([4, 4], device)
    for name, gemm in (("grouped_gemm_by_weight", lambda: K.grouped_gemm_by_weight(rows, weights, offsets,
                                                                                    backend="cuda_sm90")),
                       ("grouped_wgrad", lambda: K.grouped_wgrad(grad_cols, x_cols, backend=TILES_NOT_A_BACKEND))):
        with pytest.raises(TypeError, match=f"^{name}: backend must be a GemmBackend, got "):
            gemm()



@pytest.mark.gpu
@pytest.mark.parametrize("experts,k,n", [(8, 7168, 4096), (8, 2048, 7168)], ids=["fc1", "fc2"])
def test_grouped_gemm_matches_per_expert_scaled_mm(experts, k, n):
    """On the GPU, against cuBLASLt's blockwise scaled_mm per expert at DeepSeek-V3's shapes."""
    counts = [700, 0, 1, 3, 129, 2048, 64, 1000]
    rows = _rows_operand(sum(counts), k, "cuda", seed=12)
    weights = _weights(experts, n, k, "cuda", seed=13)
    ours = K.grouped_gemm_by_weight(rows, weights, _offsets(counts, "cuda")).double().cpu()
    start, worst_eps = 0, 0.0
    x = _dequantized_rows(rows)
    for e, count in enumerate(counts):
        if count:
            padded = -(-count // 4) * 4  # cuBLASLt's M multiple; the extra rows are the next expert's
            stop = min(start + padded, rows.data.shape[0])
            a = rows.data[start:stop]
            if a.shape[0] % 4:
                a = torch.cat([a, a.new_zeros(4 - a.shape[0] % 4, k)])
            scales = torch.ones(k // 128, a.shape[0], device="cuda")
            scales[:, : stop - start] = rows.block_scales[:, start:stop]
            b, scale_b = weights[e].scaled_mm_operand()
            theirs = F.scaled_mm(a, b, scales.t(), F.ScalingType.BlockWise1x128, scale_b,
                                 F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)[:count].double().cpu()
            mine = ours[start:start + count]
            magnitude = x[start:start + count].abs() @ _dequantized_weight(weights[e]).t().abs()
            slack = (mine - theirs).abs() - BF16_ROUNDING * (mine.abs() + theirs.abs())
            worst_eps = max(worst_eps, float((slack / (2 * magnitude).clamp_min(1e-300)).max()))
        start += count
    print(f"worst accumulation difference against scaled_mm: {worst_eps:.2e} of D (bound {EPS_GPU:.2e})")
    assert worst_eps <= EPS_GPU


def _rows_with_a_nan_and_a_zero_row(counts, k: int) -> FP8BlockTensor:
    """FP8 rows on the GPU for the bit-equality tests: 2^20 of range, row 5 NaN, row 6 all zeros."""
    x = torch.randn(sum(counts), k) * torch.exp2(torch.randint(-10, 10, (sum(counts), k)).float())
    x[5] = float("nan")
    x[6] = 0.0
    return K.quantize_fp8_rows(x.bfloat16().cuda())


def test_cuda_tiles_are_refused_when_changed_and_off_the_gpu(device):
    """The CUDA kernels' tiles are fixed but for their stages, width and row-tile groups, their operands must suit them,
    and they need an SM90 GPU: each refused with its reason, before anything runs."""
    grad_cols, x_cols = _cols_operands([4, 4], 128, 256, device, seed=24)
    rows, weights = _rows_operand(8, 256, device, seed=25), _weights(2, 256, 256, device, seed=26)
    offsets = _offsets([4, 4], device)
    gemms = {"wgrad": lambda tiles, *dtype: K.grouped_wgrad(grad_cols, x_cols, *dtype, tiles=tiles, backend=CUDA),
             "by_weight": lambda tiles, *dtype: K.grouped_gemm_by_weight(rows, weights, offsets, *dtype, tiles=tiles,
                                                                         backend=CUDA)}
    for gemm in gemms.values():
        for changed in (dict(block_m=64), dict(num_warps=4), dict(row_halves=2), dict(tma=False)):
            with pytest.raises(ValueError, match="CUDA kernel takes"):
                gemm(dataclasses.replace(CUDA_TILES, **changed))
        for stages in (1, 6):
            with pytest.raises(ValueError, match="2 to 5 stages at block_n 128"):
                gemm(dataclasses.replace(CUDA_TILES, num_stages=stages))
        with pytest.raises(ValueError, match="2 to 3 stages at block_n 256"):
            gemm(dataclasses.replace(CUDA_TILES, num_stages=4, block_n=256))
        with pytest.raises(ValueError, match="block_n 128 or 256"):
            gemm(dataclasses.replace(CUDA_TILES, block_n=64))
        for group_m in (0, 65):
            with pytest.raises(ValueError, match="group_m 1 to 64"):
                gemm(dataclasses.replace(CUDA_TILES, group_m=group_m))
        with pytest.raises(ValueError, match="writes BF16 or fp32"):
            gemm(CUDA_TILES, torch.float16)
        if device.type == "cpu":
            with pytest.raises(RuntimeError, match="needs a GPU"):
                gemm(CUDA_TILES)
    narrow = _weights(2, 384, 256, device, seed=27)  # N = 384: not a multiple of 256
    with pytest.raises(ValueError, match="multiple of block_n 256"):
        K.grouped_gemm_by_weight(rows, narrow, offsets, tiles=CUDA_WIDE_TILES, backend=CUDA)
    misaligned = torch.empty(rows.block_scales.numel() + 1, device=device)[1:].view_as(rows.block_scales)
    unaligned_rows = FP8BlockTensor(rows.data, misaligned.copy_(rows.block_scales))
    with pytest.raises(ValueError, match="contiguous and 16-byte aligned"):
        K.grouped_gemm_by_weight(unaligned_rows, weights, offsets, tiles=CUDA_TILES, backend=CUDA)


def test_the_cuda_kernels_are_the_default_on_sm90_only(monkeypatch):
    """default_backend: the CUDA kernels on compute capability 9.0, the Triton kernels on other GPUs and
    on the CPU; each backend's default tiles: the CUDA forward and data gradients in groups of 4 row
    tiles, 256 columns wide where N and K are >= 4096 and N a multiple of 256."""
    from megatron_fp4.kernels import grouped_gemm_sm90
    from megatron_fp4.kernels.grouped_fp8_gemm import default_backend, default_rows_tiles, default_wgrad_tiles

    gpu = torch.device("cuda")
    monkeypatch.setattr(grouped_gemm_sm90, "_capability", lambda device: (9, 0))
    assert default_backend(gpu) is CUDA and default_backend(torch.device("cpu")) is TRITON
    for other in ((8, 0), (10, 0)):
        monkeypatch.setattr(grouped_gemm_sm90, "_capability", lambda device, c=other: c)
        assert default_backend(gpu) is TRITON
    assert default_wgrad_tiles(CUDA) == CUDA_TILES
    assert default_rows_tiles(CUDA, 2048, 7168) == CUDA_ROWS_TILES  # fc2's data gradient
    assert default_rows_tiles(CUDA, 4096, 7168) == CUDA_WIDE_TILES  # fc1's forward
    assert default_rows_tiles(CUDA, 7168, 2048) == CUDA_ROWS_TILES  # fc2's forward: K < 4096
    assert default_rows_tiles(CUDA, 4224, 7168) == CUDA_ROWS_TILES  # not a multiple of 256
    assert CUDA_ROWS_TILES.group_m == CUDA_WIDE_TILES.group_m == 4 and CUDA_TILES.group_m == 8
    assert default_rows_tiles(TRITON, 4096, 7168) == DEFAULT_ROWS_TILES
    assert default_wgrad_tiles(TRITON) == DEFAULT_WGRAD_TILES


def _cuda_tiles(kernel: str, columns: int):
    """Every stage count of a CUDA kernel ("ROWS" or "WGRAD") at both tile widths that divide the
    output's columns, in its default row-tile groups; and the first of them in the other groups of 1,
    4 and 8 (another tile order: the same sums)."""
    from megatron_fp4.kernels import grouped_gemm_sm90 as sm90

    gemm = getattr(sm90, kernel)
    default = CUDA_ROWS_TILES if kernel == "ROWS" else CUDA_TILES
    tiles = [dataclasses.replace(default, num_stages=stages, block_n=block_n) for block_n in sm90.BLOCK_NS
             if columns % block_n == 0 for stages in gemm.stage_counts(block_n)]
    return tiles + [dataclasses.replace(tiles[0], group_m=group_m) for group_m in (1, 4, 8) if group_m != default.group_m]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,counts", [(4096, 7168, [700, 0, 1, 3, 129, 2048, 64, 1000]),
                                        (7168, 2048, [700, 0, 1, 3, 129, 2048, 64, 1000]),
                                        (256, 384, [1, 0, 260]), (128, 128, [0, 5, 0])],
                         ids=["fc1", "fc2", "small", "one_step"])
def test_cuda_wgrad_gives_the_triton_kernels_bits(n, k, counts):
    """The CUDA kernel sums the same products in the same order as the Triton kernel: equal bits in
    BF16 and fp32 and when adding into fp32 buffers, on ragged segments with empty and one-token
    experts, at every stage count, also with fewer K steps than stages; the first token's X holds a NaN,
    so its expert's gradient has a NaN column (BF16 NaN 0x7FC0 as in the Triton kernel)."""
    grad_cols, x_cols = _cols_operands(counts, n, k, "cuda", seed=27, nan_token=0)
    nan_expert = next(e for e, count in enumerate(counts) if count)
    for out_dtype, bits in ((torch.bfloat16, torch.int16), (torch.float32, torch.int32)):
        expected = K.grouped_wgrad(grad_cols, x_cols, out_dtype, backend=TRITON).view(bits)
        assert torch.isnan(expected.view(out_dtype)[nan_expert, :, 3]).all()
        assert torch.isnan(expected.view(out_dtype)).sum() == n
        for tiles in _cuda_tiles("WGRAD", k):
            ours = K.grouped_wgrad(grad_cols, x_cols, out_dtype, tiles=tiles, backend=CUDA)
            assert torch.equal(ours.view(bits), expected), f"{out_dtype}, {tiles}"
    expected = [torch.full((n, k), 0.25, device="cuda") for _ in counts]
    K.grouped_wgrad(grad_cols, x_cols, accumulate_into=expected, backend=TRITON)
    for tiles in _cuda_tiles("WGRAD", k):
        ours = [torch.full((n, k), 0.25, device="cuda") for _ in counts]
        K.grouped_wgrad(grad_cols, x_cols, accumulate_into=ours, tiles=tiles, backend=CUDA)
        for e, (mine, theirs) in enumerate(zip(ours, expected)):
            assert torch.equal(mine.view(torch.int32), theirs.view(torch.int32)), f"expert {e}, {tiles}"


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("experts,k,n", [(8, 7168, 4096), (8, 2048, 7168), (3, 384, 256), (3, 128, 256),
                                         (70, 256, 256)],
                         ids=["fc1", "fc2", "small", "one_k_step", "seventy_experts"])
def test_cuda_rows_kernel_gives_the_triton_kernels_bits(experts, k, n, out_dtype):
    """The CUDA forward / data-gradient kernel sums the same products in the same order as the Triton
    kernel: equal bits on ragged segments with empty and one-token experts, partial tiles whose
    next rows are another expert's, a NaN row and an all-zero row, at every stage count."""
    # 70 experts: more than the 32 the kernel's first warp counts row tiles of per pass.
    counts = {8: [700, 0, 1, 3, 129, 2048, 64, 1000], 3: [1, 0, 260],
              70: torch.randint(0, 40, (70,), generator=torch.Generator().manual_seed(29)).tolist()}[experts]
    rows = _rows_with_a_nan_and_a_zero_row(counts, k)
    weights = _weights(experts, n, k, "cuda", seed=28)
    offsets = _offsets(counts, "cuda")
    expected = K.grouped_gemm_by_weight(rows, weights, offsets, out_dtype, backend=TRITON)
    bits = torch.int16 if out_dtype == torch.bfloat16 else torch.int32
    for tiles in _cuda_tiles("ROWS", n):
        ours = K.grouped_gemm_by_weight(rows, weights, offsets, out_dtype, tiles=tiles, backend=CUDA)
        assert torch.equal(ours.view(bits), expected.view(bits)), str(tiles)
    assert torch.isnan(expected[5]).all() and not torch.isnan(expected[7:]).any()


# --- offsets and block scales as the kernels read them ------------------------------------------


def _bad_row_offsets(m: int):
    """Offsets of three experts over m rows, each breaking one rule: rows left unwritten, rows written
    past the output, reads before the first row, a segment of negative length."""
    return {"ends_short": [0, 10, 20, m - 7], "ends_past_the_rows": [0, 10, 20, m + 100],
            "starts_past_0": [5, 10, 20, m], "starts_before_0": [-64, 10, 20, m], "decreases": [0, 30, 20, m]}


BAD_ROW_OFFSETS = list(_bad_row_offsets(0))
ON_THE_CPU = pytest.mark.skipif(torch.cuda.is_available(), reason="a device-side assert ends the CUDA context: "
                                "test_bad_row_offsets_stop_the_gpu runs it in a process of its own")


@ON_THE_CPU
@pytest.mark.parametrize("case", BAD_ROW_OFFSETS)
@pytest.mark.parametrize("backend", [TRITON, CUDA], ids=["triton", "cuda_sm90"])
def test_grouped_gemm_refuses_bad_row_offsets(device, case, backend):
    """row_offsets are asserted on the device before any kernel reads them (under the interpreter the
    assert raises at once), for the CUDA kernels' wrappers too, before they ask for a GPU."""
    m = int(torch.randint(40, 100, (1,)))
    offsets = torch.tensor(_bad_row_offsets(m)[case], device=device)
    weights = _weights(3, 128, 512, device, seed=30)
    with pytest.raises(RuntimeError, match="row_offsets must start at 0, never decrease and end at"):
        tiles = SMALL_TILES if backend is TRITON else CUDA_ROWS_TILES
        K.grouped_gemm_by_weight(_rows_operand(m, 512, device, seed=31), weights, offsets, tiles=tiles, backend=backend)


def test_grouped_gemm_refuses_row_offsets_of_the_wrong_kind(device):
    rows, weights = _rows_operand(8, 256, device, seed=32), _weights(2, 128, 256, device, seed=33)
    with pytest.raises(TypeError, match="row_offsets must be a tensor"):
        K.grouped_gemm_by_weight(rows, weights, [0, 4, 8])
    for wrong in (_offsets([4, 4], device).int(), _offsets([4, 2, 2], device),
                  torch.tensor([0, 4, 8], device="meta")):
        with pytest.raises(ValueError, match=f"row_offsets must be int64 \\[3\\] on {device}"):
            K.grouped_gemm_by_weight(rows, weights, wrong)


def test_grouped_gemm_takes_good_row_offsets_with_and_without_the_check(device):
    """Fresh ragged counts, empty experts first and last: the checked call passes and gives the bits of
    the unchecked one."""
    counts = [0, *torch.randint(0, 60, (2,)).tolist(), 0]
    rows, weights = _rows_operand(sum(counts), 256, device, seed=34), _weights(4, 128, 256, device, seed=35)
    offsets = _offsets(counts, device)
    checked = K.grouped_gemm_by_weight(rows, weights, offsets, torch.float32)
    assert torch.equal(checked, K.grouped_gemm_by_weight(rows, weights, offsets, torch.float32, check_offsets=False))
    exact, magnitude = _oracle_rows(rows, weights, counts)
    _assert_within(checked, exact, magnitude, _eps(device, 256), 2.0**-24)


@pytest.mark.gpu
def test_bad_row_offsets_stop_the_gpu(tmp_path):
    """On the GPU the assert is a device-side one: the process's next synchronization fails, and the
    GEMM queued after it never reads the offsets (run in a process of its own: the CUDA context is lost)."""
    import subprocess
    import sys

    script = tmp_path / "bad_offsets.py"
    script.write_text(
        "import torch\nfrom megatron_fp4 import kernels as K\n"
        "rows = K.quantize_fp8_rows(torch.randn(97, 256, device='cuda').bfloat16())\n"
        "weights = K.quantize_fp8_weights_stacked(list(torch.randn(2, 128, 256, device='cuda').bfloat16()))\n"
        "K.grouped_gemm_by_weight(rows, weights, torch.tensor([0, 40, 200], device='cuda'))\n"
        "torch.cuda.synchronize()\nprint('not stopped')\n")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "not stopped" not in result.stdout, result.stdout + result.stderr[-2000:]
    # CUDA prints the failed assertion of torch's assert kernel; the next launch then fails with the
    # sticky error (torch: "device-side assert triggered"; our CUDA GEMM's driver call: CUDA_ERROR_ASSERT).
    assert "_assert_async_cuda_kernel" in result.stderr, result.stderr[-2000:]
    assert "device-side assert" in result.stderr or "CUDA_ERROR_ASSERT" in result.stderr, result.stderr[-2000:]


def _with_offsets(t: FP8BlockTensor, offsets) -> FP8BlockTensor:
    return FP8BlockTensor(t.data, t.block_scales, COLWISE, torch.tensor(offsets, device=t.data.device))


@ON_THE_CPU
@pytest.mark.parametrize("case", ["not_whole_blocks", "past_the_capacity", "decreasing", "starts_past_0",
                                  "differ_between_operands"])
@pytest.mark.parametrize("backend", [TRITON, CUDA], ids=["triton", "cuda_sm90"])
def test_grouped_wgrad_refuses_bad_segment_offsets(device, case, backend):
    counts = torch.randint(1, 128, (2,)).tolist()  # segments [0, 128, 256]
    grad_cols, x_cols = _cols_operands(counts, 128, 128, device, seed=36)
    capacity = grad_cols.shape[1]
    bad = {"not_whole_blocks": [0, 100, 256], "past_the_capacity": [0, 128, capacity + 128],
           "decreasing": [0, 256, 128], "starts_past_0": [128, 128, 256], "differ_between_operands": [0, 0, 256]}[case]
    grad_cols = _with_offsets(grad_cols, bad)
    if case != "differ_between_operands":
        x_cols = _with_offsets(x_cols, bad)
    with pytest.raises(RuntimeError, match="grad_cols.segment_offsets must be multiples of 128, start at 0"):
        K.grouped_wgrad(grad_cols, x_cols, backend=backend)


def test_grouped_wgrad_refuses_segment_offsets_of_the_wrong_kind(device):
    grad_cols, x_cols = _cols_operands([4, 4], 128, 128, device, seed=37)
    with pytest.raises(ValueError, match=f"input_cols.segment_offsets must be int64 \\[3\\] on {device}"):
        K.grouped_wgrad(grad_cols, _with_offsets(x_cols, [0, 128]))
    with pytest.raises(ValueError, match=f"grad_cols.segment_offsets must be int64 \\[3\\] on {device}"):
        K.grouped_wgrad(FP8BlockTensor(grad_cols.data, grad_cols.block_scales, COLWISE,
                                       grad_cols.segment_offsets.int()), x_cols)


def _strided(scales: torch.Tensor) -> torch.Tensor:
    """The same values with the strides of their transpose (as scaled_mm's scales are laid out)."""
    strided = scales.t().contiguous().t()
    assert torch.equal(strided, scales) and not strided.is_contiguous()
    return strided


@pytest.mark.parametrize("backend", [TRITON, CUDA], ids=["triton", "cuda_sm90"])
def test_grouped_gemms_refuse_strided_block_scales(device, backend):
    """The kernels read block scales as contiguous [K / 128, M] (or [capacity / 128, N]): other strides
    are refused in one sentence naming the operand, where they used to give wrong products."""
    counts = torch.randint(1, 60, (2,)).tolist()
    rows, weights = _rows_operand(sum(counts), 256, device, seed=38), _weights(2, 128, 256, device, seed=39)
    tiles = SMALL_TILES if backend is TRITON else CUDA_ROWS_TILES
    with pytest.raises(ValueError, match="rows.block_scales must be contiguous \\(row-major\\), got shape"):
        K.grouped_gemm_by_weight(FP8BlockTensor(rows.data, _strided(rows.block_scales)), weights,
                                 _offsets(counts, device), tiles=tiles, backend=backend)
    grad_cols, x_cols = _cols_operands(counts, 128, 256, device, seed=40)
    for name, operands in (("grad_cols", (grad_cols, x_cols)), ("input_cols", (x_cols, grad_cols))):
        strided = FP8BlockTensor(operands[0].data, _strided(operands[0].block_scales), COLWISE,
                                 operands[0].segment_offsets)
        pair = (strided, operands[1]) if name == "grad_cols" else (operands[1], strided)
        with pytest.raises(ValueError, match=f"{name}.block_scales must be contiguous"):
            K.grouped_wgrad(*pair, backend=backend)
