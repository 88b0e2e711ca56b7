"""The FP8 gradient's wire rows of the dispatch all-to-all (megatron_fp4/dispatch/wire.py)."""

import pytest
import torch


@pytest.mark.parametrize("hidden", [128, 256, 384])
def test_fp8_gradient_rows_pack_and_unpack_bit_exactly(device, hidden):
    """The FP8 gradient's wire rows (H E4M3 bytes, then H/128 fp32 scales), one scale per row
    (hidden 128) included, where the scales' transposed copy kept a stride the byte view refused."""
    from megatron_fp4.dispatch.wire import pack_fp8_rows, unpack_fp8_rows
    from megatron_fp4.kernels import quantize_fp8_rows

    g = torch.Generator().manual_seed(hidden)
    q = quantize_fp8_rows((torch.randn(5, hidden, generator=g) * 3).bfloat16().to(device))
    back = unpack_fp8_rows(pack_fp8_rows(q), hidden)
    assert torch.equal(back.data.view(torch.uint8), q.data.view(torch.uint8))
    assert torch.equal(back.block_scales, q.block_scales)


@pytest.mark.parametrize("hidden", [32, 64, 96, 256])  # rows of 17, 34, 51 and 136 bytes: byte, byte, byte, 8-byte words
@pytest.mark.parametrize("offset_rows", [0, 1])
def test_mxfp4_rows_select_tokens_like_a_gather_of_the_tokens(device, hidden, offset_rows):
    """The permute done on MXFP4 wire rows (MXFP4Tensor.select_tokens) gives the rows of the
    gathered tokens: each token's copies, repeats and an empty selection, also from rows that start
    inside their buffer (a view whose offset forbids wide words)."""
    from megatron_fp4.kernels import quantize_mxfp4
    from megatron_fp4.tensors import MXFP4Tensor

    g = torch.Generator().manual_seed(hidden + offset_rows)
    tokens = (torch.randn(9, hidden, generator=g) * torch.exp2(torch.randint(-20, 20, (9, hidden), generator=g))).bfloat16()
    tokens[2] = 0  # an all-zero token
    tokens = tokens.to(device)
    q = quantize_mxfp4(tokens)
    rows = torch.cat([torch.zeros(offset_rows, q.rows.shape[1], dtype=torch.uint8, device=device), q.rows])
    q = MXFP4Tensor(rows[offset_rows:], hidden, q.scale_rule)  # storage offset: offset_rows x width bytes
    indices = torch.tensor([3, 0, 3, 8, 2, 2, 5], device=device)
    assert torch.equal(q.select_tokens(indices).rows, quantize_mxfp4(tokens[indices]).rows)
    assert q.select_tokens(indices[:0]).rows.shape == (0, q.rows.shape[1])
