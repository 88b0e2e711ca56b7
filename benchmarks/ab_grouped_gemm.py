#!/usr/bin/env python3
"""This checkout's grouped FP8 GEMM Triton kernels against another commit's, in one process: the A/B
that a kernel change is judged by (a ratio against a baseline measured in the same run, on the same
operands).

    git show C:megatron_fp4/kernels/grouped_gemm_triton.py > /tmp/baseline_gemm.py
    python -m benchmarks.ab_grouped_gemm --baseline /tmp/baseline_gemm.py --baseline-commit C

The baseline file is loaded as a module of megatron_fp4.kernels, so its relative imports resolve to
this checkout's helpers (a baseline that needs a helper this checkout no longer has fails to load,
and is refused). Each GEMM of bench_grouped_gemm (fc1 / fc2 forward, data and weight gradients at
DeepSeek-V3's expert shapes, ragged counts with a quarter of the experts empty) is launched by both
modules at their own default tiles into outputs allocated once (grouped_fp8_gemm checks the
operands; the launchers take them as checked): the two are timed in alternation --reps times and the
medians count. Their outputs' bits are compared and printed (a change meant to keep the sums says so
when it does not).
Rows: bench=grouped_gemm_ab, metric=tflops, reference "baseline C", same_bits.
"""

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable, Dict

import torch

from megatron_fp4.kernels import grouped_gemm_triton as current
from benchmarks.bench_grouped_gemm import (ROUTED_ROWS, ROWS_GEMMS, WGRAD_GEMMS, cols_operands, rows_operands,
                                           tflops, wall_ms)
from benchmarks.common import ragged_counts
from benchmarks.rows import Recorder

BASELINE_MODULE = "megatron_fp4.kernels._ab_baseline"
ENTRY_POINTS = ("launch_rows", "launch_wgrad", "DEFAULT_ROWS_TILES", "DEFAULT_WGRAD_TILES")


def load_baseline(path: Path) -> ModuleType:
    """The module of `path` (a copy of kernels/grouped_gemm_triton.py) inside megatron_fp4.kernels."""
    if not path.is_file():
        raise SystemExit(f"ab_grouped_gemm: --baseline {path} is not a file; write one with "
                         "`git show C:megatron_fp4/kernels/grouped_gemm_triton.py > FILE`")
    spec = importlib.util.spec_from_file_location(BASELINE_MODULE, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[BASELINE_MODULE] = module  # Triton reads the kernels' source through their module
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # the baseline's own import error, whatever it is, is the reason
        del sys.modules[BASELINE_MODULE]
        raise SystemExit(f"ab_grouped_gemm: the baseline {path} does not load against this checkout: "
                         f"{type(error).__name__}: {error}")
    missing = [name for name in ENTRY_POINTS if not hasattr(module, name)]
    if missing:
        raise SystemExit(f"ab_grouped_gemm: the baseline {path} lacks {', '.join(missing)}")
    return module


def alternating_rates(calls: Dict[str, Callable[[], object]], flops: float, reps: int, iters: int) -> Dict[str, float]:
    """Median TFLOP/s of each call, the calls timed one after another, `reps` rounds."""
    rates: Dict[str, list] = {name: [] for name in calls}
    for _ in range(reps):
        for name, call in calls.items():
            rates[name].append(tflops(flops, wall_ms(call, iters, 3)))
    return {name: statistics.median(values) for name, values in rates.items()}


def rows_call(module: ModuleType, rows, weights, offsets) -> Callable[[], torch.Tensor]:
    """The module's forward / data-gradient kernel at its default tiles, into a BF16 output of its own."""
    out = torch.empty(rows.shape[0], weights.data.shape[1], dtype=torch.bfloat16, device=rows.data.device)

    def call():
        module.launch_rows(rows, weights, offsets, out.view(torch.int16), True, module.DEFAULT_ROWS_TILES)
        return out
    return call


def wgrad_call(module: ModuleType, grad_cols, x_cols) -> Callable[[], torch.Tensor]:
    """The module's weight-gradient kernel at its default tiles, into a BF16 output of its own."""
    experts = grad_cols.segment_offsets.numel() - 1
    out = torch.empty(experts, grad_cols.shape[0], x_cols.shape[0], dtype=torch.bfloat16,
                      device=grad_cols.data.device)

    def call():
        module.launch_wgrad(grad_cols, x_cols, out.view(torch.int16), False, True, module.DEFAULT_WGRAD_TILES)
        return out
    return call


def gemm_calls(baseline: ModuleType, name: str, counts: torch.Tensor) -> Dict[str, Callable[[], torch.Tensor]]:
    """{"baseline": ..., "current": ...}: the GEMM `name` at each module's default tiles, same operands."""
    if name in ROWS_GEMMS:
        rows, weights, offsets, _ = rows_operands(counts, *ROWS_GEMMS[name])
        return {label: rows_call(module, rows, weights, offsets)
                for label, module in (("baseline", baseline), ("current", current))}
    grad_cols, x_cols = cols_operands(counts, *WGRAD_GEMMS[name])
    return {label: wgrad_call(module, grad_cols, x_cols)
            for label, module in (("baseline", baseline), ("current", current))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", type=Path, required=True, help="a copy of kernels/grouped_gemm_triton.py")
    p.add_argument("--baseline-commit", required=True, help="the commit the baseline file comes from (for the rows)")
    p.add_argument("--experts", type=int, nargs="+", default=[32, 8], help="local experts")
    p.add_argument("--gemms", nargs="+", choices=list(ROWS_GEMMS) + list(WGRAD_GEMMS),
                   default=list(ROWS_GEMMS) + list(WGRAD_GEMMS))
    p.add_argument("--reps", type=int, default=3, help="alternating rounds (the median counts)")
    p.add_argument("--iters", type=int, default=20, help="back-to-back calls per timing")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("ab_grouped_gemm needs a CUDA GPU (SM90)")
    baseline = load_baseline(args.baseline)
    recorder = Recorder("grouped_gemm_ab", gpus=1, routed_rows=ROUTED_ROWS, reps=args.reps, iters=args.iters)
    print(recorder.description())
    print("| GEMM | local experts | current TFLOP/s | baseline TFLOP/s | current / baseline | same bits |")
    print("| --- | --- | --- | --- | --- | --- |")
    for experts in args.experts:
        counts = ragged_counts(ROUTED_ROWS, experts, seed=experts)
        for name in args.gemms:
            calls = gemm_calls(baseline, name, counts)
            same = torch.equal(calls["current"]().view(torch.int16), calls["baseline"]().view(torch.int16))
            n, k = ROWS_GEMMS.get(name) or WGRAD_GEMMS[name]
            rates = alternating_rates(calls, 2.0 * ROUTED_ROWS * n * k, args.reps, args.iters)
            recorder.add(name, "tflops", rates["current"], "TFLOP/s", f"baseline {args.baseline_commit}",
                         rates["baseline"], better="higher", local_experts=experts, same_bits=same)
            print(f"| {name} | {experts} | {rates['current']:.0f} | {rates['baseline']:.0f} | "
                  f"{rates['current'] / rates['baseline']:.3f} | {'yes' if same else 'NO'} |", flush=True)
    recorder.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
