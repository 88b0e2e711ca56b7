"""The atomic-free sums of rows by token (the MoE unpermute and the permute's gradient) bit for bit
against the reference: ragged tokens (none, one, many rows), NaN/Inf, subnormals, a 2^20 range,
negative zeros, BF16 and fp32, widths that are not a multiple of the kernel's slice."""

import pytest
import torch

from megatron_fp4 import reference as ref
from megatron_fp4.dispatch.permute import TokenRows
from megatron_fp4.kernels.row_sums import sum_rows_by_token

from support.inputs import assert_same_bits, hard_input


def _token_of_each_row(num_tokens: int, rows: int, seed: int) -> torch.Tensor:
    """A token per row, shuffled; the first tokens get none, one and eight rows."""
    g = torch.Generator().manual_seed(seed)
    fixed = torch.tensor([1] + [2] * 8, dtype=torch.int64)  # token 0: none, token 1: one, token 2: eight
    rest = torch.randint(3, num_tokens, (rows - fixed.numel(),), generator=g)
    tokens = torch.cat([fixed, rest])
    return tokens[torch.randperm(rows, generator=g)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", [256, 300])
def test_sums_equal_the_reference(device, dtype, hidden):
    num_tokens, rows = 24, 80
    x = hard_input(rows, hidden, dtype, seed=hidden)  # NaN, Inf, subnormals, a 2^20 range, -0 in rows 0-9
    x[10:12] = torch.finfo(dtype).max  # one token's two largest finite rows: their sum overflows to Inf
    indices = _token_of_each_row(num_tokens, rows, seed=5)
    indices[10:12] = indices[12]
    token_rows = TokenRows.of(indices.to(device), num_tokens)
    out = token_rows.sums(x.to(device))
    expected = ref.sum_rows_by_token(x, indices, num_tokens)
    assert_same_bits(out, expected)
    assert torch.equal(out[0].cpu(), torch.zeros(hidden, dtype=dtype))
    assert torch.isinf(out[indices[12]].float()).all() and torch.isnan(out.float()).any()


def test_order_within_a_token_is_ascending_position(device):
    """fp32 addition is not associative: 1 + 2^24 - 2^24 is 0 in that order, 1 in another."""
    x = torch.tensor([[2.0**24], [1.0], [-(2.0**24)]], dtype=torch.float32)
    for indices, expected in (([0, 0, 0], 0.0), ([1, 0, 0], -(2.0**24) + 1), ([0, 1, 0], 0.0)):
        token_rows = TokenRows.of(torch.tensor(indices, device=device), 2)
        out = token_rows.sums(x.to(device)).cpu()
        assert out[0, 0].item() == expected
        assert_same_bits(out, ref.sum_rows_by_token(x, torch.tensor(indices), 2))


def test_no_tokens_and_no_rows(device):
    empty = sum_rows_by_token(torch.zeros(0, 64, device=device), torch.zeros(0, dtype=torch.int64, device=device),
                              torch.zeros(4, dtype=torch.int64, device=device))
    assert empty.shape == (3, 64) and not empty.any()
    none = sum_rows_by_token(torch.zeros(0, 64, device=device), torch.zeros(0, dtype=torch.int64, device=device),
                             torch.zeros(1, dtype=torch.int64, device=device))
    assert none.shape == (0, 64)


def test_refusals(device):
    order = torch.zeros(2, dtype=torch.int64, device=device)
    offsets = torch.tensor([0, 2], device=device)
    with pytest.raises(ValueError, match="rows must be a 2-D tensor"):
        sum_rows_by_token(torch.zeros(2, 8, dtype=torch.float16, device=device), order, offsets)
    with pytest.raises(ValueError, match="order must be 1-D int64"):
        sum_rows_by_token(torch.zeros(2, 8, device=device), order.int(), offsets)
    with pytest.raises(ValueError, match="offsets needs T"):
        sum_rows_by_token(torch.zeros(2, 8, device=device), order, offsets[:0])
