#!/usr/bin/env python3
"""Where the MoE layer's forward+backward time goes, per GPU kernel (torch.profiler), for one or
more of the experts configurations of bench_moe_layer.py. Rank 0 prints, per configuration, the
wall time per step next to the GPU kernel time summed (a large gap means the CPU cannot keep the GPU
busy) and the kernels by total GPU time.

    torchrun --nproc-per-node 2 scripts/profile_moe_layer.py --experts 16 --layer stock,fp4-fp8
"""

import sys
import time

import torch
import torch.distributed as dist
from bench_moe_layer import layer_step, moe_config, parse_args, start_expert_parallel

LAYERS = {"stock": (False, "bf16"), "fp8-baseline": (False, "fp8"), "fp4-bf16": (True, "bf16"), "fp4-fp8": (True, "fp8")}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    layer_names = ["fp4-fp8"]
    if "--layer" in argv:
        i = argv.index("--layer")
        layer_names = argv[i + 1].split(",")
        del argv[i : i + 2]
    unknown = [name for name in layer_names if name not in LAYERS]
    if unknown:
        raise SystemExit(f"--layer takes a comma-separated list of {sorted(LAYERS)}, got {unknown}")
    args = parse_args(argv, description=__doc__, experts_table=False)
    from megatron.core import parallel_state

    rank, world, log = start_expert_parallel(args, f"profiling {', '.join(layer_names)}")
    for name in layer_names:
        profile_layer(args, name, rank, world, log)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


def profile_layer(args, layer_name: str, rank: int, world: int, log) -> None:
    from megatron_fp4.dispatch import FP4DispatchOptions
    from megatron_fp4.integration.standalone import build_moe_layer

    fp4, experts = LAYERS[layer_name]
    layer = build_moe_layer(moe_config(args, world), FP4DispatchOptions() if fp4 else None, experts=experts).cuda()
    g = torch.Generator(device="cuda").manual_seed(rank)
    x = torch.randn(args.tokens, 1, args.hidden, device="cuda", generator=g).bfloat16()
    grad = torch.randn(x.shape, device="cuda", generator=g).bfloat16()
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
    del layer, step
    torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
