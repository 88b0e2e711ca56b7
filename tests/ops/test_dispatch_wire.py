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


# Rows of 17, 34, 51, 68 and 136 bytes: moved as bytes, bytes, bytes, 4-byte and 8-byte words.
@pytest.mark.parametrize("hidden", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("offset_bytes", [0, 4])
def test_mxfp4_rows_select_tokens_like_a_gather_of_the_tokens(device, hidden, offset_bytes):
    """The permute done on MXFP4 wire rows (MXFP4Tensor.select_tokens) gives the rows of the
    gathered tokens: each token's copies, repeats and an empty selection, also from rows that start
    4 bytes into their buffer (an offset that allows 4-byte words but not 8-byte ones)."""
    from megatron_fp4.kernels import quantize_mxfp4
    from megatron_fp4.tensors import MXFP4Tensor

    g = torch.Generator().manual_seed(hidden + offset_bytes)
    tokens = (torch.randn(9, hidden, generator=g) * torch.exp2(torch.randint(-20, 20, (9, hidden), generator=g))).bfloat16()
    tokens[2] = 0  # an all-zero token
    tokens = tokens.to(device)
    q = quantize_mxfp4(tokens)
    flat = torch.zeros(offset_bytes + q.rows.numel(), dtype=torch.uint8, device=device)
    rows = flat[offset_bytes:].view(q.rows.shape)
    rows.copy_(q.rows)
    q = MXFP4Tensor(rows, hidden, q.scale_rule)
    indices = torch.tensor([3, 0, 3, 8, 2, 2, 5], device=device)
    assert torch.equal(q.select_tokens(indices).rows, quantize_mxfp4(tokens[indices]).rows)
    assert q.select_tokens(indices[:0]).rows.shape == (0, q.rows.shape[1])
