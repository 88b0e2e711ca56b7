"""Ahead-of-time compilation of every kernel for sm_90 (Hopper), no GPU needed.

Triton's interpreter runs the kernels' Python on a CPU but accepts code that the compiler refuses
(globals, loop-carried shape changes, ...). Compiling for GPUTarget("cuda", 90) with Triton's own
ptxas catches those on a CPU-only machine, and the SASS it yields shows what a kernel costs
(benchmarks/kernel_sass_stats.py).
"""

import dataclasses
import sys
from typing import List

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import (fp8_dequantize, fp8_quantize, fp8_quantize_both, fp8_quantize_cols, fp8_quantize_weight,
               fp8_transpose_weight, grouped_gemm_triton, mxfp4_dequantize, mxfp4_quantize, mxfp4_to_fp8, row_sums,
               swiglu, swiglu_forward)
from ._sm90_spec import BuildVariant, KernelSpec

SM90 = GPUTarget("cuda", 90, 32)

# Every module with a Triton kernel; each declares its kernels' signatures in sm90_specs(variant).
KERNEL_MODULES = (mxfp4_quantize, mxfp4_dequantize, mxfp4_to_fp8, fp8_quantize, fp8_quantize_cols, fp8_quantize_both,
                  fp8_quantize_weight, fp8_transpose_weight, swiglu, swiglu_forward, fp8_dequantize, grouped_gemm_triton,
                  row_sums)


def kernel_specs(hidden: int = 7168, ceil_rule: bool = True, input_kind: int = 0) -> List[KernelSpec]:
    """Every kernel at its default tile config for rows of `hidden` elements."""
    variant = BuildVariant(hidden, ceil_rule, input_kind)
    return [spec for module in KERNEL_MODULES for spec in module.sm90_specs(variant)]


def candidate_specs(hidden: int = 7168, input_kind: int = 0) -> List[KernelSpec]:
    """Every candidate tile config of the kernels that list them (CONFIGS, swept by
    benchmarks/bench_quantizers.py), the weight quantizer plain and transposed; names carry the
    config."""
    variant = BuildVariant(hidden, True, input_kind)
    specs = []
    for module in (fp8_quantize, fp8_quantize_cols, fp8_quantize_both):
        for config in module.CONFIGS:
            specs += module.sm90_specs(variant, config)
    for transpose in (False, True):
        for config in fp8_quantize_weight.CONFIGS:
            specs += fp8_quantize_weight.sm90_specs(variant, config, transpose)
    return [dataclasses.replace(spec, name=f"{spec.name}{'_t' if spec.constexprs.get('TRANSPOSE') else ''} "
                                f"{_config_label(spec)}") for spec in specs]


def _config_label(spec: KernelSpec) -> str:
    keys = ("BLOCK_ROWS", "TOKENS_PER_PASS", "ROWS_PER_PASS", "BLOCK_GROUPS", "BLOCK_QUADS")
    tile = [spec.constexprs[k] for k in keys if k in spec.constexprs]
    return "x".join(str(v) for v in tile) + f"/{spec.num_warps}w"


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
    return triton.compile(source, target=SM90, options={"num_warps": spec.num_warps, "num_stages": spec.num_stages})


# The variants CI compiles: the default config at two hidden sizes, both scale rules, all input kinds.
CHECKED_VARIANTS = [(7168, True, 0), (2048, False, 1), (256, True, 2)]


def main(argv=None) -> int:
    """Compile every kernel variant in CHECKED_VARIANTS (with --candidates: every candidate tile
    config of the FP8 quantizers, BF16 at hidden 7168, which a GPU sweep would compile); print one
    line each. Needs TRITON_INTERPRET unset (the interpreter has no compiler behind it)."""
    argv = sys.argv[1:] if argv is None else argv
    if "--candidates" in argv:
        builds = [((7168, True, 0), spec) for spec in candidate_specs()]
    else:
        builds = [(variant, spec) for variant in CHECKED_VARIANTS for spec in kernel_specs(*variant)]
    for (hidden, ceil_rule, input_kind), spec in builds:
        compiled = compile_sm90(spec)
        if "ld.local" in compiled.asm["ptx"]:
            raise SystemExit(f"{spec.name} (hidden {hidden}) spills to local memory")
        print(f"sm_90 ok: {spec.name} hidden={hidden} ceil={ceil_rule} kind={input_kind}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
