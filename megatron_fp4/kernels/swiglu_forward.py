"""The experts' SwiGLU forward with the quantizations of its input and output, in one pass.

The experts' forward needs, of fc2_in = silu(gate) * (linear + offset) * prob (fp32, rounded once to
the output dtype): its FP8 1x128 rows (the fc2 GEMM's operand), and then either its BF16 values
(the FP8 baseline and the recompute build FP8 columns from them) or MXFP4 rows of fc2_in and of
fc1_out (what the FP4 recipe saves for backward). Separately that is the SwiGLU, a row quantizer
and two MXFP4 quantizers, each reading its input from HBM again; here one kernel reads fc1_out
once and writes what is asked. The bytes equal those quantizers' on this kernel's values
(tests/ops/test_swiglu.py); the values are the eager definition's up to fp32 rounding (exp).

A program takes BLOCK_ROWS rows x one 128-column FP8 group of fc2_in, as [rows, 4 MXFP4 blocks,
8 quads] of four consecutive elements, so that the FP8 amax reduces over the last two axes and
each MXFP4 block's over the last one, with no reshapes.
"""

from dataclasses import dataclass
from typing import List, Optional

import torch
import triton
import triton.language as tl

from ..formats import FP8_BLOCK, MXFP4_BLOCK, check_scale_rule, mxfp4_wire_bytes_per_row
from ..tensors import ROWWISE, FP8BlockTensor, MXFP4Tensor
from ._bits import abs_max4, e4m3_word, fp32_to_bf16_bits, fp8_block_scale, load_float_quads
from ._checks import check_float_matrix, check_kernel_device, float_kind, interpreter_enabled, quad_ready
from ._format_constants import E4M3_NAN
from ._sm90_spec import BuildVariant, KernelSpec
from .mxfp4_quantize import _e2m1_code, mxfp4_block_scale

GPU_BLOCK_ROWS, INTERPRETER_BLOCK_ROWS = 8, 64  # the interpreter's cost is per program
MXFP4_BLOCK_SIZE = tl.constexpr(MXFP4_BLOCK)


@dataclass(frozen=True)
class SwiGLUOutputs:
    """What swiglu_quantized wrote: fc2_in's FP8 rows always; its values and the MXFP4 rows of
    fc2_in and fc1_out when asked (else None)."""

    fp8_rows: FP8BlockTensor
    values: Optional[torch.Tensor]
    fc2_in_mxfp4: Optional[MXFP4Tensor]
    fc1_out_mxfp4: Optional[MXFP4Tensor]


@triton.jit
def _activation_bits(gate_bits, linear_bits, prob, offset, OUT_KIND: tl.constexpr):
    """fp32 bits (int32) of silu(gate) * (linear + offset) * prob, rounded to the output dtype
    (OUT_KIND as _checks.float_kind: 0 bf16, 1 fp16, 2 fp32)."""
    gate = gate_bits.to(tl.float32, bitcast=True)
    silu = gate * (1.0 / (1.0 + tl.exp(-gate)))
    value = silu * (linear_bits.to(tl.float32, bitcast=True) + offset) * prob
    if OUT_KIND == 0:
        return fp32_to_bf16_bits(value) << 16  # round to nearest even in integers (the interpreter truncates)
    if OUT_KIND == 1:
        value = value.to(tl.float16).to(tl.float32)
    return value.to(tl.int32, bitcast=True)


@triton.jit
def _store_mxfp4_quads(rows_ptr, row, row_ok, quad, block, e0, e1, e2, e3, WIDTH: tl.constexpr,
                       ROW_BYTES: tl.constexpr, CEIL_RULE: tl.constexpr):
    """MXFP4 of [rows, blocks, 8] quads (fp32 bits of elements 4q .. 4q + 3) into the wire rows
    `row` ([rows, 1], int64; row_ok the same shape) of WIDTH elements and ROW_BYTES bytes: two data
    bytes a quad, then one scale byte a block ([1, blocks])."""
    scale_byte, inv_scale, is_nan = mxfp4_block_scale(tl.max(abs_max4(e0, e1, e2, e3), axis=2), CEIL_RULE)
    inv = inv_scale[:, :, None]
    low = _e2m1_code(e0, inv, not CEIL_RULE) | (_e2m1_code(e1, inv, not CEIL_RULE) << 4)
    high = _e2m1_code(e2, inv, not CEIL_RULE) | (_e2m1_code(e3, inv, not CEIL_RULE) << 4)
    pair = tl.where(is_nan[:, :, None], 0, low | (high << 8))  # a NaN block stores all-zero codes
    row_start = rows_ptr + row * ROW_BYTES
    quads_ok = row_ok[:, :, None] & (quad >= 0)
    tl.store(row_start[:, :, None].to(tl.pointer_type(tl.int16)) + quad, pair.to(tl.int16), mask=quads_ok)
    tl.store(row_start + WIDTH // 2 + block, scale_byte.to(tl.uint8), mask=row_ok & (block >= 0))


@triton.jit
def _bits16(a, OUT_KIND: tl.constexpr):
    """The 16-bit pattern (int32) of an fp32 value (bits) exact in the output's 16-bit dtype."""
    if OUT_KIND == 0:
        return (a >> 16) & 0xFFFF
    return a.to(tl.float32, bitcast=True).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _store_values(values_ptr, row_quad, row_ok, a0, a1, a2, a3, OUT_KIND: tl.constexpr):
    """The output values (fp32 bits) in the output dtype: four 16-bit floats as one int64, or four fp32."""
    if OUT_KIND != 2:
        low = _bits16(a0, OUT_KIND) | (_bits16(a1, OUT_KIND) << 16)
        high = _bits16(a2, OUT_KIND) | (_bits16(a3, OUT_KIND) << 16)
        word = (low.to(tl.int64) & 0xFFFFFFFF) | (high.to(tl.int64) << 32)
        tl.store(values_ptr.to(tl.pointer_type(tl.int64)) + row_quad, word, mask=row_ok)
    else:
        words = values_ptr.to(tl.pointer_type(tl.int32)) + 4 * row_quad
        tl.store(words, a0, mask=row_ok)
        tl.store(words + 1, a1, mask=row_ok)
        tl.store(words + 2, a2, mask=row_ok)
        tl.store(words + 3, a3, mask=row_ok)


@triton.jit
def _swiglu_quantized_kernel(
    fc1_pairs_ptr,  # fc1_out [rows, 2 FFN] (_checks.pair_view)
    probs_ptr,
    fp8_words_ptr,  # int32 view of fc2_in's E4M3 rows [rows, FFN]
    fp8_scales_ptr,  # fp32 [FFN / 128, rows]
    values_ptr,  # fc2_in [rows, FFN] in the output dtype (KEEP_VALUES)
    fc2_in_mxfp4_ptr,  # uint8 wire rows of fc2_in (MXFP4)
    fc1_out_mxfp4_ptr,  # uint8 wire rows of fc1_out (MXFP4)
    num_rows,
    offset,
    FFN: tl.constexpr,
    KIND: tl.constexpr,
    OUT_KIND: tl.constexpr,
    KEEP_VALUES: tl.constexpr,
    MXFP4: tl.constexpr,
    CEIL_RULE: tl.constexpr,
    FC2_ROW_BYTES: tl.constexpr,  # MXFP4 wire rows of fc2_in (FFN elements) and of fc1_out (2 FFN)
    FC1_ROW_BYTES: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    group = tl.program_id(1)  # the FP8 group of fc2_in's columns
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    block = group * 4 + tl.arange(0, 4)[None, :]  # MXFP4 blocks of the group: 4 x 32 columns
    quad = 8 * block[:, :, None] + tl.arange(0, 8)[None, None, :]  # [1, 4, 8] quads of fc2_in's row
    row64 = row.to(tl.int64)[:, None, None]
    row_ok = (row < num_rows)[:, None, None] & (quad >= 0)  # full [rows, 4, 8] shape
    gate_quad = row64 * (FFN // 2) + quad  # fc1_out rows: FFN / 2 quads, the gate's, then the linear's
    g0, g1, g2, g3 = load_float_quads(fc1_pairs_ptr, gate_quad, row_ok, KIND)
    l0, l1, l2, l3 = load_float_quads(fc1_pairs_ptr, gate_quad + FFN // 4, row_ok, KIND)
    prob = tl.load(probs_ptr + row, mask=row < num_rows, other=0).to(tl.float32)[:, None, None]
    a0 = _activation_bits(g0, l0, prob, offset, OUT_KIND)
    a1 = _activation_bits(g1, l1, prob, offset, OUT_KIND)
    a2 = _activation_bits(g2, l2, prob, offset, OUT_KIND)
    a3 = _activation_bits(g3, l3, prob, offset, OUT_KIND)

    # FP8 1x128 rows of fc2_in, as the row quantizer writes them.
    scale, inv_scale, is_nan = fp8_block_scale(tl.max(tl.max(abs_max4(a0, a1, a2, a3), axis=2), axis=1))
    words = e4m3_word(a0, a1, a2, a3, inv_scale[:, None, None])
    words = tl.where(is_nan[:, None, None], E4M3_NAN * 0x01010101, words)
    row_quad = row64 * (FFN // 4) + quad
    tl.store(fp8_words_ptr + row_quad, words, mask=row_ok)
    tl.store(fp8_scales_ptr + group.to(tl.int64) * num_rows + row, scale, mask=row < num_rows)
    if KEEP_VALUES:
        _store_values(values_ptr, row_quad, row_ok, a0, a1, a2, a3, OUT_KIND)
    if MXFP4:
        rows, rows_ok = row.to(tl.int64)[:, None], (row < num_rows)[:, None]
        _store_mxfp4_quads(fc2_in_mxfp4_ptr, rows, rows_ok, quad, block, a0, a1, a2, a3, FFN, FC2_ROW_BYTES,
                           CEIL_RULE)
        _store_mxfp4_quads(fc1_out_mxfp4_ptr, rows, rows_ok, quad, block, g0, g1, g2, g3, 2 * FFN, FC1_ROW_BYTES,
                           CEIL_RULE)
        _store_mxfp4_quads(fc1_out_mxfp4_ptr, rows, rows_ok, quad + FFN // 4, block + FFN // MXFP4_BLOCK_SIZE,
                           l0, l1, l2, l3, 2 * FFN, FC1_ROW_BYTES, CEIL_RULE)


def swiglu_quantized(fc1_out: torch.Tensor, probs: torch.Tensor, offset: float, out_dtype: torch.dtype,
                     keep_values: bool, mxfp4_rule: Optional[str]) -> SwiGLUOutputs:
    """fc1_out [T, 2F] (bf16, fp16 or fp32; F a multiple of 128), probs [T] -> SwiGLUOutputs:
    fc2_in = silu(gate) * (linear + offset) * prob in out_dtype (bf16, fp16 or fp32) as FP8 1x128 rows;
    with keep_values its values; with mxfp4_rule ("ceil" / "floor") MXFP4 rows of fc2_in and
    fc1_out. On CUDA, or on the CPU under Triton's interpreter."""
    check_float_matrix("swiglu_quantized", fc1_out, 2 * FP8_BLOCK)
    check_kernel_device("swiglu_quantized", fc1_out)
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"swiglu_quantized: out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    if mxfp4_rule is not None:
        check_scale_rule(mxfp4_rule)
    num_rows, ffn = fc1_out.shape[0], fc1_out.shape[1] // 2
    if probs.shape != (num_rows,) or probs.device != fc1_out.device or not probs.is_floating_point():
        raise ValueError(f"swiglu_quantized: probs ({probs.dtype} {tuple(probs.shape)} on {probs.device}) must be "
                         f"floats [T] on fc1_out's device; fc1_out is {tuple(fc1_out.shape)} on {fc1_out.device}")
    device = fc1_out.device
    fp8_rows = FP8BlockTensor(torch.empty(num_rows, ffn, dtype=torch.float8_e4m3fn, device=device),
                              torch.empty(ffn // FP8_BLOCK, num_rows, dtype=torch.float32, device=device), ROWWISE)
    values = torch.empty(num_rows, ffn, dtype=out_dtype, device=device) if keep_values else None
    fc2_in_mxfp4 = fc1_out_mxfp4 = None
    if mxfp4_rule is not None:
        fc2_in_mxfp4 = MXFP4Tensor.empty(num_rows, ffn, device, mxfp4_rule)
        fc1_out_mxfp4 = MXFP4Tensor.empty(num_rows, 2 * ffn, device, mxfp4_rule)
    if num_rows:
        block_rows = INTERPRETER_BLOCK_ROWS if interpreter_enabled() and not fc1_out.is_cuda else GPU_BLOCK_ROWS
        unused = fp8_rows.data  # a placeholder for the outputs not asked for: the kernel never touches it
        _swiglu_quantized_kernel[(triton.cdiv(num_rows, block_rows), ffn // FP8_BLOCK)](
            quad_ready(fc1_out), probs.contiguous(), fp8_rows.data.view(torch.int32),
            fp8_rows.block_scales, unused if values is None else values,
            unused if fc2_in_mxfp4 is None else fc2_in_mxfp4.rows,
            unused if fc1_out_mxfp4 is None else fc1_out_mxfp4.rows, num_rows, float(offset),
            FFN=ffn, KIND=float_kind(fc1_out.dtype), OUT_KIND=float_kind(out_dtype), KEEP_VALUES=keep_values,
            MXFP4=mxfp4_rule is not None, CEIL_RULE=mxfp4_rule != "floor", FC2_ROW_BYTES=mxfp4_wire_bytes_per_row(ffn),
            FC1_ROW_BYTES=mxfp4_wire_bytes_per_row(2 * ffn), BLOCK_ROWS=block_rows, num_warps=4)
    return SwiGLUOutputs(fp8_rows, values, fc2_in_mxfp4, fc1_out_mxfp4)


def sm90_specs(variant: BuildVariant) -> List[KernelSpec]:
    """The kernel at FFN 2048 from BF16 fc1_out, for both experts' paths (the FP4 recipe's MXFP4
    copies; the baseline's BF16 values), as sm90_build compiles it (no hidden size in it)."""
    ffn = 2048
    signature = {"fc1_pairs_ptr": "*i32", "probs_ptr": "*fp32", "fp8_words_ptr": "*i32", "fp8_scales_ptr": "*fp32",
                 "values_ptr": "*bf16", "fc2_in_mxfp4_ptr": "*u8", "fc1_out_mxfp4_ptr": "*u8", "num_rows": "i32",
                 "offset": "fp32"}
    return [KernelSpec(name, _swiglu_quantized_kernel, signature,
                       {"FFN": ffn, "KIND": 0, "OUT_KIND": 0, "KEEP_VALUES": keep_values, "MXFP4": mxfp4,
                        "CEIL_RULE": variant.ceil_rule, "FC2_ROW_BYTES": mxfp4_wire_bytes_per_row(ffn),
                        "FC1_ROW_BYTES": mxfp4_wire_bytes_per_row(2 * ffn), "BLOCK_ROWS": GPU_BLOCK_ROWS},
                       4, GPU_BLOCK_ROWS * FP8_BLOCK)
            for name, keep_values, mxfp4 in (("swiglu_quantized_mxfp4", False, True),
                                             ("swiglu_quantized_values", True, False))]
