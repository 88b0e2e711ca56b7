"""The MXFP4 payload in DeepEP's FP8 slot (megatron_fp4/dispatch/deepep.py): packed and unpacked byte
for byte, for every hidden size the repository's configs use, on random rows (every byte value) and
on rows quantized from hard inputs; widths DeepEP cannot carry this way are refused."""

import pathlib

import pytest
import torch
import yaml

from megatron_fp4.dispatch.deepep import pack_for_fp8_slot, unpack_from_fp8_slot
from megatron_fp4.formats import mxfp4_wire_bytes_per_row
from megatron_fp4.reference import quantize_mxfp4
from megatron_fp4.tensors import MXFP4Tensor

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"


def _config_hidden_sizes():
    sizes = set()
    for path in CONFIGS.rglob("*.yaml"):
        for document in yaml.safe_load_all(path.read_text()):
            if isinstance(document, dict) and isinstance(document.get("hidden_size"), int):
                sizes.add(document["hidden_size"])
    return sorted(sizes)


HIDDEN_SIZES = _config_hidden_sizes()


def test_the_configs_have_hidden_sizes():
    assert 7168 in HIDDEN_SIZES and len(HIDDEN_SIZES) >= 3, HIDDEN_SIZES


@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
def test_packing_is_byte_exact_both_ways(hidden):
    g = torch.Generator().manual_seed(hidden)
    rows = torch.randint(0, 256, (5, mxfp4_wire_bytes_per_row(hidden)), dtype=torch.uint8, generator=g)
    payload = MXFP4Tensor(rows, hidden, "ceil")
    codes, scales = pack_for_fp8_slot(payload)
    assert codes.dtype == torch.float8_e4m3fn and tuple(codes.shape) == (5, hidden // 2) and codes.is_contiguous()
    assert scales.dtype == torch.float32 and tuple(scales.shape) == (5, hidden // 128) and scales.is_contiguous()
    assert codes.shape[1] * codes.element_size() % 16 == 0  # DeepEP's row-bytes rule
    assert torch.equal(codes.view(torch.uint8), rows[:, : hidden // 2])
    assert torch.equal(scales.view(torch.uint8), rows[:, hidden // 2:])
    back = unpack_from_fp8_slot(codes, scales, hidden, "ceil")
    assert torch.equal(back.rows, rows) and back.hidden == hidden


def test_packing_hard_rows_and_a_view():
    hidden = 256
    x = torch.randn(6, hidden).bfloat16()
    x[0] = float("nan")
    x[1, :32] = float("inf")
    x[2] = 0  # all-zero blocks
    x[3, :32] = torch.tensor(2.0 ** -133).bfloat16()  # BF16 subnormals
    x[4, :32] = torch.exp2(torch.linspace(-10, 10, 32)).bfloat16()  # 2^20 inside one block
    payload = quantize_mxfp4(x)
    wide = torch.zeros(8, payload.rows.shape[1] + 7, dtype=torch.uint8)
    wide[1:7, 3:3 + payload.rows.shape[1]] = payload.rows
    offset = MXFP4Tensor(wide[1:7, 3:3 + payload.rows.shape[1]], hidden, "ceil")  # non-contiguous, offset
    for p in (payload, offset):
        assert torch.equal(unpack_from_fp8_slot(*pack_for_fp8_slot(p), hidden, "ceil").rows, payload.rows)


def test_widths_the_slot_cannot_carry_are_refused():
    rows = torch.zeros(2, mxfp4_wire_bytes_per_row(64), dtype=torch.uint8)
    with pytest.raises(ValueError, match="divisible by 128"):
        pack_for_fp8_slot(MXFP4Tensor(rows, 64, "ceil"))
    codes, scales = torch.zeros(2, 128, dtype=torch.float8_e4m3fn), torch.zeros(2, 2, dtype=torch.float32)
    with pytest.raises(ValueError, match="do not hold hidden"):
        unpack_from_fp8_slot(codes, scales, 512, "ceil")
