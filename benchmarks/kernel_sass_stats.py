#!/usr/bin/env python3
"""Compile each kernel for sm_90 on a machine without a GPU and count its SASS instructions.

A memory-bound kernel on H200 has about 33 thread-instructions per nanosecond to spend (132 SMs x
128 lanes x 1.98 GHz) against 4.2 bytes of copy bandwidth: at 16384 x 7168 the quantizer's
70 us memory floor allows roughly 20 instructions per element. This script prints instructions
per element (static count over elements per program) so that a change
can be judged before it costs device time. The count is static: a loop the compiler keeps (the
two-pass weight candidates' passes) counts once, so their figure understates.

    python -m benchmarks.kernel_sass_stats [--dump DIR] [--candidates]
"""

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

import triton

from megatron_fp4.kernels.sm90_build import candidate_specs, compile_sm90, kernel_specs


def sass_histogram(cubin: bytes):
    """(instruction histogram, registers per thread, stack bytes per thread) of a cubin, read with
    Triton's cuobjdump. A stack means ptxas spilled registers (or the kernel calls a function): the
    PTX that sm90_build checks does not show it."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_]*)", text)
    regs, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    return collections.Counter(ops), int(regs.group(1)) if regs else -1, int(stack.group(1)) if stack else -1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dump", help="write each kernel's ttgir and ptx into this folder")
    parser.add_argument("--candidates", action="store_true",
                        help="the FP8 quantizers' candidate tile configs (bench_quantizers sweeps them) instead")
    args = parser.parse_args(argv)
    print(f"{'kernel':30s} {'instr':>6s} {'per elem':>8s} {'LDG':>4s} {'STG':>4s} {'LDS/STS':>7s} {'regs':>5s} "
          f"{'stack':>5s}  top ops")
    for spec in candidate_specs() if args.candidates else kernel_specs():
        name, warps, elements = spec.name, spec.num_warps, spec.elements_per_program
        compiled = compile_sm90(spec)
        hist, regs, stack = sass_histogram(compiled.asm["cubin"])
        total = sum(hist.values())
        per_thread = elements / (warps * 32)
        shared = hist["LDS"] + hist["STS"]
        top = ", ".join(f"{op} {n}" for op, n in hist.most_common(6))
        print(f"{name:30s} {total:6d} {total / per_thread:8.1f} {hist['LDG']:4d} {hist['STG']:4d} {shared:7d} "
              f"{regs:5d} {stack:5d}  {top}")
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            for kind in ("ttgir", "ptx"):
                with open(os.path.join(args.dump, f"{name.replace(' ', '_').replace('/', '_')}.{kind}"), "w") as f:
                    f.write(compiled.asm[kind])
    return 0


if __name__ == "__main__":
    sys.exit(main())
