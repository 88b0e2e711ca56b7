"""The fused rows + ragged columns FP8 quantizer (one read for both encodings) bit for bit against
the reference's two quantizers: every config, every input dtype, the hard cases along rows and
along tokens, empty experts, segments of 1 and of 128 + k tokens, fresh random counts, an input at an
odd storage offset, a capacity past the tokens' need."""

import pytest
import torch

import megatron_fp4 as mf
from megatron_fp4 import reference as ref
from megatron_fp4.kernels import TileConfig, fp8_quantize_both

from support.inputs import assert_same_fp8, column_hard_cases, hard_input

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _assert_both(x, counts, **kwargs):
    rows, cols = mf.quantize_fp8_rows_and_cols(x, torch.tensor(counts, device=x.device), **kwargs)
    assert_same_fp8(rows, ref.quantize_fp8_rows(x))
    assert_same_fp8(cols, ref.quantize_fp8_cols(x, counts, capacity=kwargs.get("capacity")))


@pytest.mark.parametrize("config", fp8_quantize_both.CONFIGS, ids=str)
def test_every_config_on_the_hard_cases(device, config):
    counts = [5, 0, 131, 1, 0, 64]  # empty experts, segments of 1 and of 128 + 3 tokens
    x = column_hard_cases(hard_input(sum(counts), 256, torch.bfloat16, seed=71, device=device))
    _assert_both(x, counts, config=config)


# The multi-pass default with the two dtypes the hard-case test above does not cover (the interpreter
# is slow on its passes), the one-pass tile with all three.
@pytest.mark.parametrize(("dtype", "config"),
                         [(dtype, fp8_quantize_both.DEFAULT_CONFIG) for dtype in FLOAT_DTYPES[1:]]
                         + [(dtype, fp8_quantize_both.INTERPRETER_CONFIG) for dtype in FLOAT_DTYPES], ids=str)
def test_every_input_dtype(device, dtype, config):
    counts = [5, 0, 131, 1, 0, 64]
    x = column_hard_cases(hard_input(sum(counts), 384, dtype, seed=70, device=device))
    _assert_both(x, counts, config=config)


@pytest.mark.parametrize("counts", [[0, 0, 0, 17], [128, 128], [300], [0, 0]])
def test_segment_shapes(device, counts):
    x = column_hard_cases(hard_input(max(sum(counts), 10), 256, torch.bfloat16, seed=72, device=device))[:sum(counts)]
    _assert_both(x, counts)


def test_fresh_random_counts_and_values(device):
    seed = int(torch.randint(1 << 30, (1,)))
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 200, (9,), generator=g)
    counts[torch.randint(0, 9, (2,), generator=g)] = 0
    x = hard_input(int(counts.sum()) + 10, 512, torch.bfloat16, seed=seed, device=device)
    x = x[torch.randperm(x.shape[0], generator=g)[:int(counts.sum())]]  # the hard rows land in random segments
    try:
        _assert_both(x, counts.tolist())
    except AssertionError as error:
        raise AssertionError(f"seed {seed}, counts {counts.tolist()}") from error


def test_input_at_an_odd_storage_offset(device):
    counts = [40, 0, 3]
    buffer = hard_input(sum(counts) + 11, 256, torch.bfloat16, seed=73, device=device).reshape(-1)
    x = buffer[1:1 + sum(counts) * 256].view(sum(counts), 256)
    assert x.storage_offset() == 1
    _assert_both(x, counts)


@pytest.mark.parametrize("config", [fp8_quantize_both.DEFAULT_CONFIG, fp8_quantize_both.INTERPRETER_CONFIG], ids=str)
def test_capacity_past_the_need(device, config):
    counts = [70, 3]
    x = hard_input(sum(counts), 256, torch.float32, seed=74, device=device)
    _assert_both(x, counts, capacity=512, config=config)


def test_refuses_another_tile(device):
    x = torch.zeros(128, 256, device=device)
    with pytest.raises(ValueError, match="32 quads"):
        mf.quantize_fp8_rows_and_cols(x, torch.tensor([128], device=device), config=TileConfig(64, 16, 8))
    for tokens_per_pass in (48, 8, 256):
        with pytest.raises(ValueError, match="power of two"):
            mf.quantize_fp8_rows_and_cols(x, torch.tensor([128], device=device),
                                          config=TileConfig(tokens_per_pass, 32, 4))
    with pytest.raises(ValueError, match="capacity"):
        mf.quantize_fp8_rows_and_cols(x, torch.tensor([128], device=device), capacity=100)
