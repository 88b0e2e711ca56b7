"""Each Triton kernel equals the reference bit for bit. On CI this runs the kernels' own code under
TRITON_INTERPRET=1; on a GPU machine the same tests run compiled on CUDA."""

import dataclasses

import pytest
import torch

import megatron_fp4 as mf
from megatron_fp4 import reference as ref
from megatron_fp4.formats import mxfp4_wire_bytes_per_row
from megatron_fp4.kernels import mxfp4_dequantize, mxfp4_quantize, mxfp4_to_fp8
from megatron_fp4.kernels.mxfp4_to_fp8 import DEFAULT_ROWS_CONFIG
from megatron_fp4.tensors import FP8BlockTensor, MXFP4Tensor

from support.inputs import (assert_same_bits, assert_same_fp8, assert_same_mxfp4, column_hard_cases,
                            every_code_at_every_gap, hard_input, random_input)

FLOAT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def gpu_and_interpreter_configs(gpu, interpreted):
    """A kernel's GPU tile config and its interpreter one (what CPU runs launch by default,
    kernels/_checks.py::launch_config): the tests run both, so CI checks the GPU's bit for bit."""
    return pytest.mark.parametrize("config", [gpu, interpreted], ids=["gpu_config", "interpreter_config"])


QUANTIZE_CONFIGS = gpu_and_interpreter_configs(mxfp4_quantize.DEFAULT_CONFIG, mxfp4_quantize.INTERPRETER_CONFIG)
DEQUANTIZE_CONFIGS = gpu_and_interpreter_configs(mxfp4_dequantize.DEFAULT_CONFIG,
                                                 mxfp4_dequantize.INTERPRETER_CONFIG)
ROWS_CONFIGS = gpu_and_interpreter_configs(mxfp4_to_fp8.DEFAULT_ROWS_CONFIG, mxfp4_to_fp8.INTERPRETER_ROWS_CONFIG)
COLS_CONFIGS = gpu_and_interpreter_configs(mxfp4_to_fp8.DEFAULT_COLS_CONFIG, mxfp4_to_fp8.INTERPRETER_COLS_CONFIG)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("scale_rule", ["ceil", "floor"])
@pytest.mark.parametrize("shape", [(19, 256), (40, 9 * 32)])
@QUANTIZE_CONFIGS
def test_quantize_mxfp4(device, dtype, scale_rule, shape, config):
    x = hard_input(*shape, dtype, seed=shape[0], device=device)
    out = MXFP4Tensor.empty(*shape, device, scale_rule)
    out.rows.fill_(0xA5)  # poison: every byte must be written
    q = mf.quantize_mxfp4(x, scale_rule, out=out, config=config)
    assert_same_mxfp4(q, ref.quantize_mxfp4(x, scale_rule))


@pytest.mark.parametrize("seed", range(3))
@QUANTIZE_CONFIGS
def test_quantize_mxfp4_fresh_random(device, seed, config):
    rows = int(torch.randint(1, 70, (1,)))
    blocks = int(torch.randint(1, 40, (1,)))
    x = random_input(rows, blocks * 32, torch.bfloat16, seed=100 + seed, device=device)
    assert_same_mxfp4(mf.quantize_mxfp4(x, config=config), ref.quantize_mxfp4(x))


@QUANTIZE_CONFIGS
def test_quantize_mxfp4_into_a_wire_buffer_slice(device, config):
    x = hard_input(12, 256, torch.bfloat16, seed=7, device=device)
    wire = torch.full((20, mxfp4_wire_bytes_per_row(256)), 0xA5, dtype=torch.uint8, device=device)
    q = mf.quantize_mxfp4(x, out=MXFP4Tensor(wire[4:16], 256), config=config)
    assert_same_mxfp4(q, ref.quantize_mxfp4(x))
    assert (wire[:4] == 0xA5).all() and (wire[16:] == 0xA5).all()


@pytest.mark.parametrize("scale_rule", ["ceil", "floor"])
@DEQUANTIZE_CONFIGS
def test_dequantize_mxfp4(device, scale_rule, config):
    x = hard_input(21, 384, torch.float32, seed=8, device=device)
    q = ref.quantize_mxfp4(x, scale_rule)
    assert_same_bits(mf.dequantize_mxfp4(q, config), ref.dequantize_mxfp4(q))


@DEQUANTIZE_CONFIGS
def test_dequantize_mxfp4_every_code_and_scale(device, config):
    # All 256 packed bytes under every scale byte 0..255 (bf16 subnormals, overflow and NaN).
    data = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(256, 1)  # [256 rows, 512 elements]
    scales = torch.arange(256, dtype=torch.int32).to(torch.uint8)[:, None].repeat(1, 16)
    q = MXFP4Tensor.from_parts(data.to(device), scales.to(device))
    assert_same_bits(mf.dequantize_mxfp4(q, config), ref.dequantize_mxfp4(q))


@pytest.mark.parametrize("top_byte", [200, 30, 5])
def test_fp4_to_fp8_rows_exhaustive(device, top_byte):
    # Every code at every gap, one (gap, sign) per row and one row per program: each row takes the
    # fast path or the exact one (gaps over 11) by itself, as each single-gap tile of eight
    # single-code rows did in the default tiling (which the other tests run).
    q = every_code_at_every_gap(top_byte, min(30, top_byte))
    q = MXFP4Tensor(q.rows.to(device), q.hidden)
    one_row = dataclasses.replace(DEFAULT_ROWS_CONFIG, block_rows=1)
    assert_same_fp8(mf.mxfp4_to_fp8_rows(q, one_row), ref.mxfp4_to_fp8_rows(q))


@pytest.mark.parametrize("scale_rule", ["ceil", "floor"])
@ROWS_CONFIGS
def test_fp4_to_fp8_rows(device, scale_rule, config):
    x = hard_input(37, 640, torch.bfloat16, seed=9, device=device)
    q = ref.quantize_mxfp4(x, scale_rule)
    assert_same_fp8(mf.mxfp4_to_fp8_rows(q, config), ref.mxfp4_to_fp8_rows(q))


@pytest.mark.parametrize(
    "counts",
    [
        [0, 130, 5, 0, 165],  # empty experts, short blocks, T = 300 not a multiple of 128
        [128, 128],  # aligned
        [0, 0, 0, 17],
        [300],
    ],
)
@COLS_CONFIGS
def test_fp4_to_fp8_cols_ragged(device, counts, config):
    tokens = sum(counts)
    x = hard_input(tokens, 512, torch.bfloat16, seed=tokens, device=device)
    q = ref.quantize_mxfp4(x)
    tokens_per_expert = torch.tensor(counts, dtype=torch.int32, device=device)
    assert_same_fp8(mf.mxfp4_to_fp8_cols(q, tokens_per_expert, config=config), ref.mxfp4_to_fp8_cols(q, counts))


@COLS_CONFIGS
def test_fp4_to_fp8_cols_random_segments(device, config):
    g = torch.Generator().manual_seed(11)
    counts = torch.randint(0, 90, (9,), generator=g)
    counts[torch.randint(0, 9, (2,), generator=g)] = 0
    x = random_input(int(counts.sum()), 256, torch.bfloat16, seed=12, device=device)
    q = ref.quantize_mxfp4(x)
    got = mf.mxfp4_to_fp8_cols(q, counts.to(device), config=config)
    assert_same_fp8(got, ref.mxfp4_to_fp8_cols(q, counts.tolist()))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_quantize_fp8_rows(device, dtype):
    x = hard_input(23, 384, dtype, seed=13, device=device)
    assert_same_fp8(mf.quantize_fp8_rows(x), ref.quantize_fp8_rows(x))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("counts", [[5, 0, 130, 1, 0, 64], [0, 0, 0, 17], [128, 128], [300]])
def test_quantize_fp8_cols_ragged(device, dtype, counts):
    x = column_hard_cases(hard_input(sum(counts), 256, dtype, seed=sum(counts), device=device))
    tokens_per_expert = torch.tensor(counts, dtype=torch.int32, device=device)
    assert_same_fp8(mf.quantize_fp8_cols(x, tokens_per_expert), ref.quantize_fp8_cols(x, counts))


def test_quantize_fp8_cols_fresh_random_segments(device):
    g = torch.Generator().manual_seed(21)
    counts = torch.randint(0, 200, (11,), generator=g)
    counts[torch.randint(0, 11, (3,), generator=g)] = 0
    x = random_input(int(counts.sum()), 384, torch.bfloat16, seed=22, device=device)
    got = mf.quantize_fp8_cols(x, counts.to(device))
    expected = ref.quantize_fp8_cols(x, counts.tolist())
    assert_same_fp8(got, expected)
    # The operand is X^T per segment: dequantized, each segment's columns are its tokens, within
    # E4M3's rounding (half a unit: 2^-4 relative for normals, 2^-10 x scale for subnormals).
    dequantized = ref.dequantize_fp8(expected, torch.float32)
    scale = expected.scaled_mm_scales().repeat_interleave(128, dim=1)  # [H, capacity]
    start = 0
    for expert, count in enumerate(counts.tolist()):
        column = int(expected.segment_offsets[expert])
        segment = dequantized[:, column : column + count].t()
        tokens = x[start : start + count].float()
        bound = tokens.abs() * 2**-4 + scale[:, column : column + count].t() * 2**-10
        assert ((segment - tokens).abs() <= bound).all()
        start += count


def test_dequantize_fp8_rows_and_cols(device):
    x = hard_input(30, 256, torch.bfloat16, seed=14, device=device)
    rows = ref.quantize_fp8_rows(x)
    assert_same_bits(mf.dequantize_fp8(rows), ref.dequantize_fp8(rows))
    cols = ref.mxfp4_to_fp8_cols(ref.quantize_mxfp4(x), [10, 0, 20])
    assert_same_bits(mf.dequantize_fp8(cols), ref.dequantize_fp8(cols))


def _at_storage_offset(x: torch.Tensor, elements: int) -> torch.Tensor:
    """The values of x in a view that starts `elements` into its buffer."""
    flat = x.reshape(-1)
    return torch.cat([flat[:elements], flat])[elements:].view(x.shape)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_quantize_mxfp4_input_at_an_odd_storage_offset(device, dtype):
    """A view one element into its buffer cannot be read as pairs of elements: it is copied first,
    and quantizes as the reference does."""
    rows, blocks = int(torch.randint(1, 40, (1,))), int(torch.randint(1, 12, (1,)))
    x = _at_storage_offset(random_input(rows, blocks * 32, dtype, seed=int(torch.randint(1000, (1,))),
                                        device=device), 1)
    assert x.storage_offset() == 1
    assert_same_mxfp4(mf.quantize_mxfp4(x), ref.quantize_mxfp4(x))


def test_dequantize_fp8_at_an_odd_storage_offset_and_strided_scales(device):
    # At least two rows: one row's transposed scales are [H/128, 1], contiguous whatever the strides.
    x = random_input(int(torch.randint(2, 40, (1,))), 256, torch.bfloat16, seed=15, device=device)
    t = ref.quantize_fp8_rows(x)
    odd = FP8BlockTensor(_at_storage_offset(t.data.view(torch.uint8), 1).view(torch.float8_e4m3fn), t.block_scales)
    assert odd.data.storage_offset() == 1
    assert_same_bits(mf.dequantize_fp8(odd), ref.dequantize_fp8(t))
    strided = FP8BlockTensor(t.data, t.block_scales.t().contiguous().t())
    with pytest.raises(ValueError, match="dequantize_fp8: block_scales must be contiguous"):
        mf.dequantize_fp8(strided)


# --- refusals -------------------------------------------------------------------------------


def test_refuses_bad_inputs(device):
    x = torch.randn(4, 256, device=device)
    with pytest.raises(TypeError, match="dtype"):
        mf.quantize_mxfp4(x.to(torch.int32))
    with pytest.raises(ValueError, match="multiple of 32"):
        mf.quantize_mxfp4(x[:, :40].contiguous())
    with pytest.raises(ValueError, match="contiguous"):
        mf.quantize_mxfp4(x[:, ::2])
    with pytest.raises(ValueError, match="2-D"):
        mf.quantize_mxfp4(x.reshape(2, 2, 256))
    with pytest.raises(ValueError, match="scale_rule"):
        mf.quantize_mxfp4(x, "round")
    with pytest.raises(ValueError, match="multiple of 128"):
        mf.quantize_fp8_rows(x[:, :96].contiguous())
    q96 = ref.quantize_mxfp4(x[:, :96].contiguous())
    with pytest.raises(ValueError, match="multiple of 128"):
        mf.mxfp4_to_fp8_rows(q96)
    q = ref.quantize_mxfp4(x)
    with pytest.raises(TypeError, match="int32 or int64"):
        mf.mxfp4_to_fp8_cols(q, torch.tensor([4.0], device=device))
    with pytest.raises(ValueError, match="capacity"):
        mf.mxfp4_to_fp8_cols(q, torch.tensor([4], device=device), capacity=64)
    with pytest.raises(ValueError, match="capacity"):
        mf.quantize_fp8_cols(torch.zeros(4, 256, device=device), torch.tensor([4], device=device), capacity=64)
    with pytest.raises(TypeError, match="tokens_per_expert"):
        mf.quantize_fp8_cols(torch.zeros(4, 256, device=device), [4])
    with pytest.raises(ValueError, match="multiple of 128"):
        mf.quantize_fp8_cols(torch.zeros(4, 96, device=device), torch.tensor([4], device=device))
    with pytest.raises(TypeError, match="MXFP4Tensor"):
        mf.dequantize_mxfp4(x)
    with pytest.raises(ValueError, match="bytes per token"):
        MXFP4Tensor(torch.zeros(4, 100, dtype=torch.uint8), 256)


def test_refuses_cpu_tensors_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="CUDA tensor"):
        mf.quantize_mxfp4(torch.randn(2, 64))


def test_counts_that_do_not_sum_to_the_tokens_are_caught_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("on CUDA this is a device-side assert, which would poison the context")
    q = ref.quantize_mxfp4(torch.randn(10, 128))
    with pytest.raises(RuntimeError, match="sum to the number of tokens"):
        mf.mxfp4_to_fp8_cols(q, torch.tensor([3, 4]))


@pytest.mark.parametrize("rows_config, cols_config", [
    (mxfp4_to_fp8.DEFAULT_ROWS_CONFIG, mxfp4_to_fp8.DEFAULT_COLS_CONFIG),
    (mxfp4_to_fp8.INTERPRETER_ROWS_CONFIG, mxfp4_to_fp8.INTERPRETER_COLS_CONFIG)],
    ids=["gpu_configs", "interpreter_configs"])
def test_fp4_to_fp8_fast_path_on_plain_activations(device, rows_config, cols_config):
    # Normal activations keep every scale gap under 12: the integer fast path alone serves them.
    x = torch.randn(300, 1024, generator=torch.Generator().manual_seed(15)).bfloat16().to(device)
    q = ref.quantize_mxfp4(x)
    gaps = q.scales.reshape(300, -1, 4).amax(-1, keepdim=True) - q.scales.reshape(300, -1, 4)
    assert gaps.max() <= 11
    assert_same_fp8(mf.mxfp4_to_fp8_rows(q, rows_config), ref.mxfp4_to_fp8_rows(q))
    counts = torch.tensor([100, 0, 200], device=device)
    assert_same_fp8(mf.mxfp4_to_fp8_cols(q, counts, config=cols_config), ref.mxfp4_to_fp8_cols(q, [100, 0, 200]))


@COLS_CONFIGS
def test_cols_with_bad_counts_stays_in_bounds_when_unchecked(device, config):
    # Counts that do not describe the tokens give garbage, never an out-of-bounds access; the
    # default check_counts=True is what reports them.
    q = ref.quantize_mxfp4(torch.randn(200, 128).to(device))
    for counts in ([-300, 400, 100], [150, 150, 150]):
        out = mf.mxfp4_to_fp8_cols(q, torch.tensor(counts, device=device), check_counts=False, config=config)
        assert out.data.shape == (128, ref.colwise_capacity(200, 3))
