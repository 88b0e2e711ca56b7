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
