#!/usr/bin/env python3
"""One forward / data-gradient grouped GEMM at one expert layout, for a profiler to attach to, with
its wall-time rate printed beside the dense FP8 GEMM's (a diagnosis aid; the figures that count
come from bench_grouped_gemm, which writes rows):

    python -m benchmarks.profile_grouped_gemm --gemm fc1_fprop --experts 1 32
    ncu --clock-control none --kernel-name regex:'gemm|xmma|cutlass' --section SpeedOfLight \\
        python -m benchmarks.profile_grouped_gemm --gemm fc1_fprop --experts 32 --warmup 0 --repeat 1

`--experts 1` puts every row in one expert: the grouped kernels then do the dense GEMM's work, so
their gap to it is the kernel's own, not the grouping's. `--even` gives every expert the same
number of rows, a multiple of 128 (no partly filled row tiles).
"""

import argparse

import torch
import torch.nn.functional as F

from megatron_fp4 import kernels as K
from megatron_fp4.kernels import GemmBackend
from benchmarks.bench_grouped_gemm import ROUTED_ROWS, ROWS_GEMMS, rows_operands, tflops, wall_ms
from benchmarks.common import ragged_counts

VARIANTS = ("dense", "triton", "cuda_sm90")


def _counts(experts: int, even: bool) -> torch.Tensor:
    if even:
        if ROUTED_ROWS % (experts * 128):
            raise SystemExit(f"--even needs {ROUTED_ROWS} rows to split into multiples of 128 over {experts} experts")
        return torch.full((experts,), ROUTED_ROWS // experts)
    return ragged_counts(ROUTED_ROWS, experts, seed=experts)


def _calls(n: int, k: int, counts: torch.Tensor):
    """The variants' zero-argument calls over the same random operands."""
    rows, weights, offsets, _ = rows_operands(counts, n, k)
    b, sb = weights[0].scaled_mm_operand()
    return {
        "dense": lambda: F.scaled_mm(rows.data, b, rows.block_scales.t(), F.ScalingType.BlockWise1x128, sb,
                                     F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16),
        "triton": lambda: K.grouped_gemm_by_weight(rows, weights, offsets, backend=GemmBackend.TRITON,
                                                   check_offsets=False),
        "cuda_sm90": lambda: K.grouped_gemm_by_weight(rows, weights, offsets, backend=GemmBackend.CUDA_SM90,
                                                      check_offsets=False),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gemm", choices=sorted(ROWS_GEMMS), default="fc1_fprop")
    p.add_argument("--experts", type=int, nargs="+", default=[1, 32])
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--even", action="store_true", help="equal expert sizes, multiples of 128")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per variant first")
    p.add_argument("--repeat", type=int, default=20, help="timed calls per variant")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_grouped_gemm needs a CUDA GPU (SM90)")
    n, k = ROWS_GEMMS[args.gemm]
    for experts in args.experts:
        calls = _calls(n, k, _counts(experts, args.even))
        for variant in args.variants:
            ms = wall_ms(calls[variant], args.repeat, args.warmup)
            print(f"{args.gemm} experts={experts}{' even' if args.even else ''} {variant}: {ms:.3f} ms, "
                  f"{tflops(2.0 * ROUTED_ROWS * n * k, ms):.0f} TFLOP/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
