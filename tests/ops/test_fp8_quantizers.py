"""The BF16 -> FP8 quantizers (rows, ragged columns, 128x128 weights) at every candidate tile config
the benchmark sweeps, bit for bit against the reference: tails of rows, groups and segments, the
E4M3 rounding they share (a magic fp32 add) on every tie, and every finite BF16 value."""

import pytest
import torch
import triton
import triton.language as tl

import megatron_fp4 as mf
from megatron_fp4 import reference as ref
from megatron_fp4.kernels import TileConfig, fp8_quantize, fp8_quantize_cols, fp8_quantize_weight
from megatron_fp4.kernels._bits import e4m3_code_bits

from support.inputs import assert_same_bits, assert_same_fp8, column_hard_cases, hard_input


@triton.jit
def _e4m3_codes_kernel(v_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(v_ptr + i, mask=i < n, other=0.0)
    tl.store(out_ptr + i, e4m3_code_bits(v) & 0x7FFFFF, mask=i < n)  # bits 7-22 must be zero too


def _e4m3_rounding_cases() -> torch.Tensor:
    """Every E4M3 magnitude (0 .. 448), every midpoint between neighbours (the ties), and 1 and 2
    fp32 ulps on each side of both; plus fp32 subnormals and values far below E4M3's smallest."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    midpoints = (codes[:-1] + codes[1:]) / 2
    anchors = torch.cat([codes, midpoints]).view(torch.int32)
    near = torch.cat([anchors + d for d in (-2, -1, 0, 1, 2)]).view(torch.float32)
    tiny = torch.tensor([2.0**-149, 2.0**-127, 2.0**-126, 2.0**-20, 2.0**-11, 2.0**-10.5])
    values = torch.cat([near, tiny])
    return values[(values >= 0) & (values <= 448)]


def test_e4m3_rounding_of_the_magic_add(device):
    v = _e4m3_rounding_cases()
    out = torch.empty(v.numel(), dtype=torch.int32, device=device)
    _e4m3_codes_kernel[(triton.cdiv(v.numel(), 1024),)](v.to(device), out, v.numel(), BLOCK=1024)
    expected = v.to(torch.float8_e4m3fn).view(torch.uint8).int()
    assert torch.equal(out.cpu(), expected), (v[out.cpu() != expected][:8], out.cpu()[out.cpu() != expected][:8])


def _every_finite_bf16_in_groups(gaps) -> torch.Tensor:
    """Every positive finite BF16 pattern once per gap: 127 consecutive patterns per 128-group,
    after a top value `gap` binades above the largest of them (it sets the scale), so each value
    meets a scale that puts it from E4M3's top binade down into its subnormals and below; signs
    alternate."""
    groups = []
    for gap in gaps:
        for start in range(0, 0x7F80, 127):
            chunk = torch.arange(start, min(start + 127, 0x7F80), dtype=torch.int32)
            chunk = torch.cat([chunk, chunk[-1:].expand(127 - chunk.numel())])
            top = torch.clamp(chunk[-1:] + 128 * gap, max=0x7F7F)
            groups.append(torch.cat([top, chunk]))
    groups += groups[: -len(groups) % 8]  # whole rows of 8 groups
    bits = torch.stack(groups)
    bits[:, 1::2] |= 0x8000
    return bits.to(torch.int16).view(torch.bfloat16).reshape(-1, 1024)


@pytest.mark.parametrize("gaps", [(0, 3, 6), (9, 12, 14), (15, 16, 17), (18, 20, 30)])
def test_quantize_fp8_rows_every_finite_bf16(device, gaps):
    x = _every_finite_bf16_in_groups(gaps).to(device)
    assert_same_fp8(mf.quantize_fp8_rows(x), ref.quantize_fp8_rows(x))


def _with_interpreters(module):
    """The sweep's candidates and the interpreter's own config (what CPU runs launch by default)."""
    return tuple(dict.fromkeys(module.CONFIGS + (module.INTERPRETER_CONFIG,)))


@pytest.mark.parametrize("config", _with_interpreters(fp8_quantize), ids=str)
def test_quantize_fp8_rows_every_config(device, config):
    # 37 rows and 5 groups: partial tiles along both for every candidate.
    x = hard_input(37, 640, torch.bfloat16, seed=61, device=device)
    assert_same_fp8(mf.quantize_fp8_rows(x, config), ref.quantize_fp8_rows(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantize_fp8_rows_input_not_8_byte_aligned(device, dtype):
    # A view starting 2 elements into its buffer cannot be read as int64 quads: it is copied first.
    buffer = hard_input(13, 256, dtype, seed=62, device=device).reshape(-1)
    x = buffer[2:2 + 12 * 256].view(12, 256)
    assert x.data_ptr() % 8 != 0
    assert_same_fp8(mf.quantize_fp8_rows(x), ref.quantize_fp8_rows(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rows_and_cols_quantizers_take_an_input_at_an_odd_storage_offset(device, dtype):
    """One element into its buffer (fp32: not on an int64 pair either): copied first, the
    reference's bits, in both the row and the column quantizer."""
    counts = torch.randint(0, 40, (3,)).tolist()
    buffer = hard_input(sum(counts) + 11, 256, dtype, seed=int(torch.randint(1000, (1,))), device=device).reshape(-1)
    x = buffer[1:1 + sum(counts) * 256].view(sum(counts), 256)
    assert x.storage_offset() == 1
    assert_same_fp8(mf.quantize_fp8_rows(x), ref.quantize_fp8_rows(x))
    assert_same_fp8(mf.quantize_fp8_cols(x, torch.tensor(counts, device=device)), ref.quantize_fp8_cols(x, counts))


@pytest.mark.parametrize("config", _with_interpreters(fp8_quantize_cols), ids=str)
def test_quantize_fp8_cols_every_config(device, config):
    counts = [5, 0, 131, 1, 0, 64]  # empty experts, segments of 1 and of 128 + 3 tokens
    x = column_hard_cases(hard_input(sum(counts), 256, torch.bfloat16, seed=63, device=device))
    got = mf.quantize_fp8_cols(x, torch.tensor(counts, device=device), config=config)
    assert_same_fp8(got, ref.quantize_fp8_cols(x, counts))


@pytest.mark.parametrize("tokens_per_pass", [128, 64])
def test_quantize_fp8_cols_partial_column_tiles(device, tokens_per_pass):
    # 256 columns a program over 384: the masked column tail no candidate reaches at H % 128 == 0.
    counts = [0, 70, 0, 3]
    x = column_hard_cases(hard_input(sum(counts), 384, torch.bfloat16, seed=65, device=device))
    config = TileConfig(block_rows=tokens_per_pass, block_cols=64, num_warps=4)
    got = mf.quantize_fp8_cols(x, torch.tensor(counts, device=device), config=config)
    assert_same_fp8(got, ref.quantize_fp8_cols(x, counts))


def test_two_pass_configs_refuse_partial_passes(device):
    x = torch.zeros(128, 256, device=device)
    for rows in (48, 8, 256):
        with pytest.raises(ValueError, match="power of two"):
            mf.quantize_fp8_cols(x, torch.tensor([128], device=device), config=TileConfig(rows, 16, 4))
        with pytest.raises(ValueError, match="power of two"):
            mf.quantize_fp8_weight(x, config=TileConfig(rows, 128, 4))


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("config", _with_interpreters(fp8_quantize_weight), ids=str)
def test_quantize_fp8_weight_every_config(device, config, transpose):
    w = hard_input(256, 384, torch.bfloat16, seed=64, device=device)
    w[128:256, 256:384] = 0.0
    got = mf.quantize_fp8_weight(w, transpose=transpose, config=config)
    expected = ref.quantize_fp8_weight(w, transpose=transpose)
    assert_same_bits(got.data, expected.data)
    assert_same_bits(got.block_scales, expected.block_scales)


def test_launches_take_the_callers_config_else_the_gpus_or_the_interpreters():
    from megatron_fp4.kernels._checks import launch_config

    for module in (fp8_quantize, fp8_quantize_cols, fp8_quantize_weight):
        # The GPU's default is a candidate; the parametrized tests above check it and the
        # interpreter's bit for bit here.
        assert module.DEFAULT_CONFIG in module.CONFIGS
        assert launch_config(None, torch.device("cuda", 0), module.DEFAULT_CONFIG,
                             module.INTERPRETER_CONFIG) == module.DEFAULT_CONFIG
        assert launch_config(None, torch.device("cpu"), module.DEFAULT_CONFIG,
                             module.INTERPRETER_CONFIG) == module.INTERPRETER_CONFIG
        chosen = module.CONFIGS[2]
        assert launch_config(chosen, torch.device("cpu"), module.DEFAULT_CONFIG, module.INTERPRETER_CONFIG) == chosen
