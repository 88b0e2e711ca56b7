"""Ahead-of-time compilation of every kernel for sm_90 (Hopper), no GPU needed.

Triton's interpreter runs the kernels' Python on a CPU but accepts code that the compiler refuses
(globals, loop-carried shape changes, ...). Compiling for GPUTarget("cuda", 90) with Triton's own
ptxas catches those on a CPU-only machine, and the SASS it yields shows what a kernel costs
(benchmarks/kernel_sass_stats.py).
"""

from dataclasses import dataclass
from typing import Dict, List

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import (fp8_dequantize, fp8_quantize, fp8_quantize_cols, fp8_quantize_weight, mxfp4_dequantize, mxfp4_quantize,
               mxfp4_to_fp8)
from ..experts import swiglu

SM90 = GPUTarget("cuda", 90, 32)


@dataclass
class KernelSpec:
    name: str
    fn: object  # the @triton.jit function
    signature: Dict[str, str]  # runtime arguments; every other parameter is a constexpr
    constexprs: Dict[str, object]
    num_warps: int
    elements_per_program: int


def kernel_specs(hidden: int = 7168, ceil_rule: bool = True, input_kind: int = 0) -> List[KernelSpec]:
    """Every kernel at its default tile config for rows of `hidden` elements."""
    q, d = mxfp4_quantize.DEFAULT_CONFIG, mxfp4_dequantize.DEFAULT_CONFIG
    r, c = mxfp4_to_fp8.DEFAULT_ROWS_CONFIG, mxfp4_to_fp8.DEFAULT_COLS_CONFIG
    f, g = fp8_quantize.DEFAULT_CONFIG, fp8_dequantize.DEFAULT_CONFIG
    fc = fp8_quantize_cols.DEFAULT_CONFIG
    blocks, groups = hidden // 32, hidden // 128
    pairs = "*i64" if input_kind == 2 else "*i32"
    return [
        KernelSpec("quantize_mxfp4", mxfp4_quantize._quantize_mxfp4_kernel,
                   {"x_pairs_ptr": pairs, "rows_ptr": "*u8", "num_rows": "i32", "x_row_stride": "i32",
                    "out_row_stride": "i32"},
                   {"BLOCKS_PER_ROW": blocks, "KIND": input_kind, "CEIL_RULE": ceil_rule,
                    "BLOCK_ROWS": q.block_rows, "BLOCK_COLS": q.block_cols},
                   q.num_warps, q.block_rows * q.block_cols * 32),
        KernelSpec("dequantize_mxfp4", mxfp4_dequantize._dequantize_mxfp4_kernel,
                   {"rows_ptr": "*u8", "out_pairs_ptr": "*i32", "num_rows": "i32", "in_row_stride": "i32"},
                   {"BLOCKS_PER_ROW": blocks, "BLOCK_ROWS": d.block_rows, "BLOCK_COLS": d.block_cols},
                   d.num_warps, d.block_rows * d.block_cols * 32),
        KernelSpec("mxfp4_to_fp8_rows", mxfp4_to_fp8._mxfp4_to_fp8_rows_kernel,
                   {"rows_ptr": "*i32", "out_ptr": "*i64", "scales_ptr": "*fp32", "num_rows": "i32",
                    "in_row_stride": "i32"},
                   {"GROUPS_PER_ROW": groups, "BLOCK_ROWS": r.block_rows, "BLOCK_GROUPS": r.block_cols},
                   r.num_warps, r.block_rows * r.block_cols * 128),
        KernelSpec("mxfp4_to_fp8_cols", mxfp4_to_fp8._mxfp4_to_fp8_cols_kernel,
                   {"rows_ptr": "*i32", "out_words_ptr": "*i32", "scales_ptr": "*fp32", "counts_ptr": "*i64",
                    "segment_offsets_ptr": "*i64", "num_rows": "i32", "num_experts": "i32", "capacity": "i32",
                    "in_row_stride": "i32"},
                   {"BLOCKS_PER_ROW": blocks, "EXPERTS_POW2": 32, "TOKENS": 128, "BLOCK_COLS": c.block_cols},
                   c.num_warps, 128 * c.block_cols * 32),
        KernelSpec("quantize_fp8_rows", fp8_quantize._quantize_fp8_rows_kernel,
                   {"x_pairs_ptr": pairs, "out_pairs_ptr": "*i16", "scales_ptr": "*fp32", "num_rows": "i32"},
                   {"GROUPS_PER_ROW": groups, "KIND": input_kind, "BLOCK_ROWS": f.block_rows,
                    "BLOCK_GROUPS": f.block_cols},
                   f.num_warps, f.block_rows * f.block_cols * 128),
        KernelSpec("quantize_fp8_cols", fp8_quantize_cols._quantize_fp8_cols_kernel,
                   {"x_pairs_ptr": pairs, "out_ptr": "*u8", "scales_ptr": "*fp32", "counts_ptr": "*i64",
                    "segment_offsets_ptr": "*i64", "num_rows": "i32", "num_experts": "i32", "capacity": "i32"},
                   {"HIDDEN": hidden, "KIND": input_kind, "EXPERTS_POW2": 32, "TOKENS": 128,
                    "BLOCK_PAIRS": fc.block_cols},
                   fc.num_warps, 128 * fc.block_cols * 2),
        # A weight [2 x 2048, hidden] (fc1's shape), transposed when ceil_rule is off so both variants build.
        KernelSpec("quantize_fp8_weight", fp8_quantize_weight._quantize_fp8_weight_kernel,
                   {"w_addresses_ptr": "*i64", "out_ptr": "*u8", "scales_ptr": "*fp32"},
                   {"ROWS": 4096, "COLS": hidden, "SCALE_STRIDE": -(-(hidden // 128) // 4) * 4, "KIND": input_kind,
                    "TRANSPOSE": not ceil_rule, "BLOCK": 128},
                   8, 128 * 128),
        # The experts' SwiGLU backward at FFN 2048 (BF16 gradients, fp32 probs).
        KernelSpec("swiglu_backward", swiglu._swiglu_backward_kernel,
                   {"fc1_out_ptr": "*bf16", "probs_ptr": "*fp32", "grad_ptr": "*bf16", "grad_fc1_out_ptr": "*i16",
                    "grad_probs_ptr": "*fp32", "num_rows": "i32", "offset": "fp32"},
                   {"FFN": 2048, "BLOCK_ROWS": 4, "BLOCK_FFN": 1024, "GRAD_BF16": True, "PROBS_BF16": False},
                   4, 4 * 2048),
        KernelSpec("dequantize_fp8", fp8_dequantize._dequantize_fp8_kernel,
                   {"data_pairs_ptr": "*i16", "scales_ptr": "*fp32", "out_pairs_ptr": "*i32", "num_rows": "i32"},
                   {"GROUPS_PER_ROW": groups, "BLOCK_ROWS": g.block_rows, "BLOCK_GROUPS": g.block_cols},
                   g.num_warps, g.block_rows * g.block_cols * 128),
    ]


def compile_sm90(spec: KernelSpec):
    """triton.compile for sm_90; pointers and strides are declared 16-byte divisible, as they are
    for the tensors the entry points pass at the benchmarked sizes."""
    params = list(spec.fn.arg_names)
    signature = {name: spec.signature.get(name, "constexpr") for name in params}
    aligned = [["tt.divisibility", 16]]
    attrs = {
        (i,): aligned
        for i, name in enumerate(params)
        if name in spec.signature and (spec.signature[name].startswith("*") or name.endswith("stride"))
    }
    source = ASTSource(fn=spec.fn, signature=signature, constexprs=spec.constexprs, attrs=attrs)
    return triton.compile(source, target=SM90, options={"num_warps": spec.num_warps})


# The variants CI compiles: the default config at two hidden sizes, both scale rules, all input kinds.
CHECKED_VARIANTS = [(7168, True, 0), (2048, False, 1), (256, True, 2)]


def main() -> int:
    """Compile every kernel variant in CHECKED_VARIANTS; print one line each. Needs
    TRITON_INTERPRET unset (the interpreter has no compiler behind it)."""
    for hidden, ceil_rule, input_kind in CHECKED_VARIANTS:
        for spec in kernel_specs(hidden, ceil_rule, input_kind):
            compiled = compile_sm90(spec)
            if "ld.local" in compiled.asm["ptx"]:
                raise SystemExit(f"{spec.name} (hidden {hidden}) spills to local memory")
            print(f"sm_90 ok: {spec.name} hidden={hidden} ceil={ceil_rule} kind={input_kind}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
