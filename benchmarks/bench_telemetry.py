#!/usr/bin/env python3
"""What --moe-fp4-telemetry costs, in one torchrun job; rank 0 appends the results to
benchmarks/results/bench_telemetry.jsonl.

    torchrun --nproc-per-node 2 -m benchmarks.bench_telemetry --experts 16
    torchrun --nproc-per-node 4 -m benchmarks.bench_telemetry               # 32 experts over EP 4

DeepSeek-V3 layer dimensions by default. Configurations (--configs): FP4 dispatch with Megatron's
BF16 experts or our FP8 experts, each without recompute and with recompute_modules ["moe"] and
the recompute cache. Per configuration two layers with the same weights and routing, telemetry off
and on, timed in turns (forward + backward each round; the "on" round also ends the telemetry's
step and reads it, as a run with --log-interval 1 does: the most often Megatron can ask).
Measured: forward+backward time of each (slowest rank's median), and the time telemetry adds
(median of the per-round differences, largest over ranks, with quartiles) against the layer's
time without it. Printed, not stored: the synchronizing CUDA calls in one forward+backward with
telemetry off and on (torch.cuda.set_sync_debug_mode), which must be equal, and the read's own.
"""

import statistics
import sys
import warnings

import torch
import torch.distributed as dist

from benchmarks.common import (finish, interleaved_times_ms, layer_options, max_over_ranks, moe_config,
                               paired_differences_ms, random_tokens, start_expert_parallel)

BENCH = "bench_telemetry"
CONFIGS = {
    "bf16": ("FP4 dispatch + BF16 experts", "bf16", False),
    "fp8": ("FP4 dispatch + FP8 experts", "fp8", False),
    "bf16-cache": ("FP4 dispatch + BF16 experts, recompute moe + cache", "bf16", True),
    "fp8-cache": ("FP4 dispatch + FP8 experts, recompute moe + cache", "fp8", True),
}


def parse(argv):
    args = layer_options(__doc__)
    args.add_argument("--configs", default=",".join(CONFIGS),
                      help=f"comma-separated, from {', '.join(CONFIGS)} (default: all)")
    args = args.parse_args(argv)
    args.configs = args.configs.split(",")
    unknown = set(args.configs) - set(CONFIGS)
    if unknown:
        raise SystemExit(f"--configs: unknown {sorted(unknown)}; choose from {', '.join(CONFIGS)}")
    return args


def forward_backward(layer, x, grad):
    out, _ = layer(x.detach().requires_grad_(True))
    out.backward(grad)


def synchronizations(fn) -> int:
    """Synchronizing CUDA calls fn makes on this rank (max over ranks)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return int(max_over_ranks(sum("synchroniz" in str(w.message) for w in caught)))


def measure(args, experts: str, cache: bool, x, grad, recording):
    """(off ms, on ms, added ms and quartiles, synchronizations off / on / in the read)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_fp4.integration.standalone import build_moe_layer
    from megatron_fp4.options import FP4Options

    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    recompute = {"recompute_granularity": "selective", "recompute_modules": ["moe"]} if cache else {}
    config = moe_config(args, dist.get_world_size(), **recompute)
    layers = {telemetry: build_moe_layer(config, FP4Options(dispatch=True, dispatch_grad=args.grad, experts=experts,
                                                            cache=cache, telemetry=telemetry)).cuda()
              for telemetry in (False, True)}
    layers[True].load_state_dict(layers[False].state_dict())
    assert layers[True].telemetry is recording and layers[False].telemetry is None

    def logged_step():
        forward_backward(layers[True], x, grad)
        recording.end_step()
        recording.read()

    times = interleaved_times_ms({False: lambda: forward_backward(layers[False], x, grad), True: logged_step},
                                 args.iters, args.warmup)
    off_ms, on_ms = (max_over_ranks(statistics.median(times[t])) for t in (False, True))
    added = paired_differences_ms(times[True], times[False], op=dist.ReduceOp.MAX)
    syncs = (synchronizations(lambda: forward_backward(layers[False], x, grad)),
             synchronizations(lambda: forward_backward(layers[True], x, grad)),
             synchronizations(lambda: (recording.end_step(), recording.read())))
    del layers
    torch.cuda.empty_cache()
    return off_ms, on_ms, added, syncs


def main(argv=None) -> int:
    args = parse(argv)
    from megatron_fp4 import telemetry

    rank, world, log, rows = start_expert_parallel(args, BENCH, "FP4 dispatch, telemetry off vs on")
    x, grad = random_tokens(args, rank)
    log("\n| configuration | off (ms) | on (ms) | added (ms, median [q1, q3]) | added / off | syncs off / on / read |")
    log("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name in args.configs:
        case, experts, cache = CONFIGS[name]
        off_ms, on_ms, (added, q1, q3), syncs = measure(args, experts, cache, x, grad, telemetry.recorder())
        log(f"| {case} | {off_ms:.3f} | {on_ms:.3f} | {added:.3f} [{q1:.3f}, {q3:.3f}] | {added / off_ms:.2%} | "
            f"{syncs[0]} / {syncs[1]} / {syncs[2]} |")
        if syncs[0] != syncs[1]:
            log(f"  WARNING: telemetry changed the synchronizing calls of {case}'s forward+backward")
        rows.add(f"{case}, telemetry on", "layer forward+backward", on_ms, "ms", f"{case}, telemetry off", off_ms)
        rows.add(case, "step time added by telemetry", added, "ms", "layer forward+backward, telemetry off",
                     off_ms, better="lower", added_quartiles=[q1, q3])
    log("\n'on' also ends the telemetry's step and reads it every round (one all-reduce and one host read), as "
        "--log-interval 1 would.")
    finish(rank, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
