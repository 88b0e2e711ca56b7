#!/usr/bin/env python3
"""Where the MoE layer's forward+backward time goes, per GPU kernel (torch.profiler), for one or
more MoE layer configurations (LAYERS). Rank 0 prints, per configuration, the
wall time per step next to the GPU kernel time summed (a large gap means the CPU cannot keep the GPU
busy) and the kernels by total GPU time; with --host also the host syncs of one step (with the
Python lines that caused them) and the CPU ops by self CPU time; with --python the Python functions
(and the C calls they make) by own host time, from cProfile (its overhead inflates every call alike);
with --gaps where the GPU idles in one step started on a synchronized GPU; with --rows the step's GPU
time by part of the layer (benchmarks/layer_breakdown.py), forward and backward, and its idle time,
as rows of benchmarks/results/moe_layer_breakdown.jsonl.

    torchrun --nproc-per-node 2 -m benchmarks.profile_moe_layer --experts 16 --layer stock,fp4-fp8 [--host]
    torchrun --nproc-per-node 2 -m benchmarks.profile_moe_layer --experts 16 --layer fp4-fp8-recompute,fp4-fp8-cache
    torchrun --nproc-per-node 2 -m benchmarks.profile_moe_layer --experts 16 --layer fp4-fp8-cache --python
    python3 -m benchmarks.profile_moe_layer --experts 32 --layer stock,fp4-fp8 --gaps
    python3 -m benchmarks.profile_moe_layer --experts 32 --layer fp4-fp8,fp8-baseline --rows

Layers: see LAYERS (the *-recompute and *-cache ones checkpoint the layer with recompute_modules
["moe"], the latter with the FP4 recompute cache on). Without --rows a profiler's printout for finding
where time goes. The profiler adds its own overhead to every launch: the rows' wall time is measured
without it, their parts under it.
"""

import collections
import cProfile
import os
import pstats
import sys
import time
import traceback
import warnings
from typing import Dict, Optional

import torch
import torch.distributed as dist

from benchmarks.common import (finish, layer_options, layer_step, moe_config, random_tokens, start_expert_parallel,
                               with_lean_permute)
from benchmarks.layer_breakdown import by_part, union_length
from benchmarks.rows import Recorder

BREAKDOWN_BENCH = "moe_layer_breakdown"

# name: (FP4 dispatch, experts, recompute_modules ["moe"], recompute cache, megatron_fp4's permute behind
# a BF16 dispatch). fp8-lean-permute is bench_moe_layer's "FP8 baseline behind megatron_fp4's permute",
# what FP4 dispatch is compared against apart from the permute.
LAYERS = {
    "stock": (False, "bf16", False, False, False), "fp8-baseline": (False, "fp8", False, False, False),
    "fp8-lean-permute": (False, "fp8", False, False, True),
    "fp4-bf16": (True, "bf16", False, False, False), "fp4-fp8": (True, "fp8", False, False, False),
    "fp4-bf16-recompute": (True, "bf16", True, False, False), "fp4-bf16-cache": (True, "bf16", True, True, False),
    "fp4-fp8-recompute": (True, "fp8", True, False, False), "fp4-fp8-cache": (True, "fp8", True, True, False),
}


def main(argv=None) -> int:
    parser = layer_options(__doc__)
    parser.add_argument("--layer", default="fp4-fp8", help=f"comma-separated, from {', '.join(LAYERS)}")
    parser.add_argument("--host", action="store_true", help="also the host syncs and CPU ops of a step")
    parser.add_argument("--python", action="store_true", help="also host time by Python function (cProfile)")
    parser.add_argument("--gaps", action="store_true",
                        help="also where the GPU idles in one step started from a synchronized GPU (as "
                             "bench_moe_layer times a step): each idle gap of 20 us or more, the kernels around "
                             "it and the CPU ops that started in it")
    parser.add_argument("--rows", action="store_true",
                        help="also write the step's GPU time by part (forward, backward) and its idle time as "
                             "rows (benchmarks/results/moe_layer_breakdown.jsonl)")
    args = parser.parse_args(argv)
    host, python, gaps = args.host, args.python, args.gaps
    layer_names = args.layer.split(",")
    unknown = [name for name in layer_names if name not in LAYERS]
    if unknown:
        raise SystemExit(f"--layer takes a comma-separated list of {sorted(LAYERS)}, got {unknown}")
    cached = [name for name in layer_names if LAYERS[name][3]]
    if args.rows and cached:
        raise SystemExit(f"--rows profiles forward alone, which would fill the recompute cache of {cached} with "
                         "payloads no backward takes: profile those layers without --rows")
    from megatron.core import parallel_state

    rank, world, log, recorder = start_expert_parallel(args, BREAKDOWN_BENCH, f"profiling {', '.join(layer_names)}")
    for name in layer_names:
        profile_layer(args, name, rank, world, log, host, python, gaps, recorder if args.rows else None)
    finish(rank, recorder)
    return 0


def profile_layer(args, layer_name: str, rank: int, world: int, log, host: bool, python: bool,
                  gaps: bool = False, recorder: Optional[Recorder] = None) -> None:
    from megatron_fp4.integration.standalone import build_moe_layer
    from megatron_fp4.options import FP4Options

    fp4, experts, recompute, cache, lean_permute = LAYERS[layer_name]
    config = moe_config(args, world, **({"recompute_granularity": "selective", "recompute_modules": ["moe"]}
                                        if recompute else {}))
    layer = build_moe_layer(config, FP4Options(dispatch=fp4, cache=cache, experts=experts)).cuda()
    if lean_permute:
        layer = with_lean_permute(layer, config)
    x, grad = random_tokens(args, rank)
    step = layer_step(layer, x, grad)
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    steps = 3
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) / steps * 1000
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    if rank == 0:
        events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
        total = sum(e.self_device_time_total for e in events)
        log(f"\n{layer_name}: wall {wall_ms:.2f} ms per step, GPU kernels {total / steps / 1000:.2f} ms "
            f"(rank 0, {steps} steps); top kernels:")
        for e in sorted(events, key=lambda e: -e.self_device_time_total)[:24]:
            log(f"{e.self_device_time_total / steps / 1000:8.3f} ms {e.count // steps:5d}x  {e.key[:110]}")
    if recorder is not None:
        forward = lambda: layer(x.detach().requires_grad_(True))  # noqa: E731 (its graph is dropped)
        record_breakdown(recorder, layer_name, prof, steps, kernel_parts(forward, steps), wall_ms, log)
    if host:  # every rank runs the step (it communicates); rank 0 prints
        log_host_side(step, steps, log if rank == 0 else (lambda *_: None))
    if python:
        log_python_side(step, steps, log if rank == 0 else (lambda *_: None))
    if gaps:
        log_idle_gaps(step, log if rank == 0 else (lambda *_: None))
    del layer, step
    torch.cuda.empty_cache()


def device_events(prof):
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def parts_per_step(events, steps: int) -> Dict[str, float]:
    """The events' GPU time per step by part (ms)."""
    return {part: us / 1000 / steps for part, us in by_part((e.name, e.time_range.elapsed_us()) for e in events).items()}


def kernel_parts(fn, steps: int) -> Dict[str, float]:
    """fn's GPU time per call by part (ms), profiled over `steps` calls."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return parts_per_step(device_events(prof), steps)


def record_breakdown(recorder: Recorder, layer_name: str, prof, steps: int, forward: Dict[str, float],
                     wall_ms: float, log) -> None:
    """Rows: each part's GPU time per step in forward and backward (backward = the step's less the
    forward's, profiled apart) and the GPU's idle time, each against the wall time per step."""
    events = device_events(prof)
    step = parts_per_step(events, steps)
    busy = union_length((e.time_range.start, e.time_range.end) for e in events) / 1000 / steps
    reference = "wall time per step over back-to-back steps (no profiler)"
    log(f"{layer_name}: GPU time by part per step (forward / backward), of {wall_ms:.2f} ms wall:")
    for part, total in step.items():
        phases = {"forward": forward[part], "backward": max(total - forward[part], 0.0)}
        for phase, ms in phases.items():
            recorder.add(layer_name, f"GPU time: {part}, {phase}", ms, "ms", reference, wall_ms)
        log(f"{phases['forward']:8.3f} {phases['backward']:8.3f} ms  {part}")
    idle = max(wall_ms - busy, 0.0)
    recorder.add(layer_name, "GPU idle (wall - GPU busy)", idle, "ms", reference, wall_ms)
    log(f"{idle:8.3f} ms idle (wall - GPU busy {busy:.2f} ms)")


def log_host_side(step, steps: int, log) -> None:
    """Where a step waits for the GPU (each synchronizing call, with the Python lines that made it,
    from torch's sync debug mode) and where its CPU time goes (ops by self CPU time)."""
    syncs = collections.Counter()
    shown = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            frames = [f for f in traceback.extract_stack()[:-1]
                      if "/torch/" not in f.filename and os.path.basename(f.filename) != "warnings.py"][-3:]
            syncs[" <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames))] += 1
        else:
            shown(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown
    torch.cuda.synchronize()
    log(f"host syncs in one step: {sum(syncs.values())}")
    for where, count in syncs.most_common():
        log(f"  {count:3d}x  {where}")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    log("CPU ops by self CPU time per step:")
    for e in events[:25]:
        log(f"{e.self_cpu_time_total / steps / 1000:8.3f} ms {e.count // steps:5d}x  {e.key[:100]}")


def log_idle_gaps(step, log, shortest_us: float = 20.0, shown: int = 12) -> None:
    """The GPU's idle gaps in one step that starts on a synchronized GPU (the benchmark's timed
    step): their total, and for the `shown` longest (in step order) the kernels before and after
    and the first CPU ops (aten and CUDA runtime calls, by name) that started during it, so that a
    launch-bound or synchronizing stretch of the step can be named."""
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        step()
        torch.cuda.synchronize()
    events = prof.events()
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    cpu_ops = sorted((e.time_range.start, e.name) for e in events if e.device_type == torch.autograd.DeviceType.CPU)
    if not kernels:
        log("no GPU activity recorded")
        return
    idle, reach, previous = [], kernels[0][1], kernels[0][2]
    for start, end, name in kernels[1:]:
        if start - reach >= shortest_us:
            idle.append((reach, start, previous, name))
        if end > reach:
            reach, previous = end, name
    span = reach - kernels[0][0]
    total = sum(end - start for start, end, _, _ in idle)
    log(f"GPU idle in one step from a synchronized start: {total / 1000:.3f} ms in {len(idle)} gaps of "
        f">= {shortest_us:.0f} us, over {span / 1000:.3f} ms from its first kernel to its last; the "
        f"{min(shown, len(idle))} longest:")
    longest = sorted(sorted(idle, key=lambda gap: gap[0] - gap[1])[:shown])
    for start, end, before, after in longest:
        during = [name for t, name in cpu_ops if start <= t < end]
        names = list(dict.fromkeys(during))[:6]
        log(f"  {(end - start) / 1000:7.3f} ms after {before[:40]} before {after[:40]}; host: {len(during)} ops, "
            f"{', '.join(n[:32] for n in names)}")


def log_python_side(step, steps: int, log, top: int = 30) -> None:
    """Host time by Python function and C call (cProfile's own time, per step), to find what keeps
    a host-bound step long."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    rows = sorted(pstats.Stats(profiler).stats.items(), key=lambda item: -item[1][2])[:top]
    log("Python by own host time per step (cProfile):")
    for (filename, line, name), (_, calls, own, cumulative, _) in rows:
        where = f"{os.path.basename(filename)}:{line} {name}" if line else name
        log(f"{own / steps * 1000:8.3f} ms own {cumulative / steps * 1000:8.3f} ms cum {calls // steps:5d}x  {where[:90]}")


if __name__ == "__main__":
    sys.exit(main())
