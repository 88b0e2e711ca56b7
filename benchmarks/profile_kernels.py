#!/usr/bin/env python3
"""Run each kernel a few times at one size, for a profiler (Nsight Compute) to attach to:

    ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python -m benchmarks.profile_kernels --tokens 16384 --hidden 7168
"""

import argparse

import torch

import megatron_fp4 as mf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    x = torch.randn(args.tokens, args.hidden, device="cuda").bfloat16()
    counts = torch.full((args.experts,), args.tokens // args.experts, device="cuda")
    counts[-1] += args.tokens - int(counts.sum())
    for _ in range(args.repeat):
        q = mf.quantize_mxfp4(x)
        mf.dequantize_mxfp4(q)
        mf.mxfp4_to_fp8_rows(q)
        mf.mxfp4_to_fp8_cols(q, counts)
        t = mf.quantize_fp8_rows(x)
        mf.dequantize_fp8(t)
    torch.cuda.synchronize()
    print("ran every kernel", args.repeat, "times at", args.tokens, "x", args.hidden)


if __name__ == "__main__":
    main()
