#!/usr/bin/env python3
"""Sweep the FP8 quantizers' candidate tile configs on one GPU, against a device-to-device copy
timed the same way in the same run.

The quantizers sit on the critical path of every FP8 linear and expert GEMM: BF16 -> FP8 rows
(`quantize_fp8_rows`), ragged expert columns (`quantize_fp8_cols`, 32 experts by default, a quarter empty),
both from one read (`quantize_fp8_rows_and_cols`, "both") and 128x128 weight blocks (`quantize_fp8_weight`,
plain and transposed). Each kernel module lists
its candidates in CONFIGS (the first is its default); this times every one, checks its output
against the reference bit for bit on the first input, and prints each kernel's best.

Timing: CUDA events around a batch of calls queued behind a GPU sleep (so the host's launch time
never shows), fresh random inputs rotating over three buffers far larger than L2, warm-up first,
median over the repeats. Effective bandwidth counts every input byte read once and every output
byte written once. Rows go to benchmarks/results/bench_quantizers.jsonl (metric "bandwidth",
ratio = share of the copy, `config` = [block_rows, block_cols, num_warps] of the module's
TileConfig: rows x 128-groups for rows, tokens per pass x column quads for cols and both, rows per
pass x 128 for the weight; `default` marks CONFIGS[0]); about a minute at the default size. Where rows,
cols and both all ran, one more row per size (metric "time", better "lower") gives the fused
quantizer's time at its default against the two separate defaults' sum, unchecked (--no-check) or
bit-exact defaults only.

    python -m benchmarks.bench_quantizers [--sizes 16384x7168] [--kernels rows,cols,both,weight,weight_t]
"""

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, List

from benchmarks.rows import Recorder

COPY = "device-to-device copy (read + write)"
EXPERTS = 32
BUFFERS = 3  # 3 x 235 MB at 16384 x 7168: each call reads an input that is not in the 50 MB L2
KERNELS = ("rows", "cols", "both", "weight", "weight_t")
# The fused rows + columns quantizer against the two it replaces, each at its default, in the same run.
SEPARATE = "quantize_fp8_rows then quantize_fp8_cols_ragged (defaults)"


@dataclass
class Case:
    name: str  # the row's case: the public function
    configs: tuple  # the module's CONFIGS; the first is the default
    run: Callable  # (x, config) -> output
    check: Callable  # (x, output) -> whether it equals the reference bit for bit
    bytes_moved: int


def _same_bits(a, b) -> bool:
    import torch

    if a.shape != b.shape:
        return False
    view = {1: torch.uint8, 4: torch.int32}[a.element_size()]
    return bool(torch.equal(a.contiguous().view(view), b.contiguous().view(view)))


def build_cases(tokens: int, hidden: int, kernels, experts: int = EXPERTS) -> List[Case]:
    import torch

    import megatron_fp4 as mf
    from megatron_fp4 import reference as ref
    from megatron_fp4.formats import FP8_BLOCK
    from megatron_fp4.kernels import fp8_quantize, fp8_quantize_both, fp8_quantize_cols, fp8_quantize_weight

    from benchmarks.common import ragged_counts

    counts = ragged_counts(tokens, experts, seed=tokens + hidden)
    counts_dev = counts.cuda()
    capacity = ref.colwise_capacity(tokens, experts)
    elements = tokens * hidden

    def same_fp8(got, expected) -> bool:
        return _same_bits(got.data, expected.data) and _same_bits(got.block_scales, expected.block_scales)

    def same_cols(got, expected) -> bool:
        return same_fp8(got, expected) and torch.equal(got.segment_offsets.cpu(), expected.segment_offsets.cpu())

    cases = {
        "rows": Case("quantize_fp8_rows", fp8_quantize.CONFIGS,
                     lambda x, cfg: mf.quantize_fp8_rows(x, config=cfg),
                     lambda x, out: same_fp8(out, ref.quantize_fp8_rows(x)),
                     elements * 3 + tokens * (hidden // FP8_BLOCK) * 4),
        "cols": Case("quantize_fp8_cols_ragged", fp8_quantize_cols.CONFIGS,
                     lambda x, cfg: mf.quantize_fp8_cols(x, counts_dev, check_counts=False, config=cfg),
                     lambda x, out: same_cols(out, ref.quantize_fp8_cols(x, counts.tolist())),
                     elements * 2 + hidden * capacity + (capacity // FP8_BLOCK) * hidden * 4),
        "both": Case("quantize_fp8_rows_and_cols_ragged", fp8_quantize_both.CONFIGS,
                     lambda x, cfg: mf.quantize_fp8_rows_and_cols(x, counts_dev, check_counts=False, config=cfg),
                     lambda x, out: (same_fp8(out[0], ref.quantize_fp8_rows(x))
                                     and same_cols(out[1], ref.quantize_fp8_cols(x, counts.tolist()))),
                     elements * 3 + tokens * (hidden // FP8_BLOCK) * 4 + hidden * capacity
                     + (capacity // FP8_BLOCK) * hidden * 4),
    }
    for name, transpose in (("weight", False), ("weight_t", True)):
        cases[name] = Case(
            "quantize_fp8_weight" + ("_t" if transpose else ""), fp8_quantize_weight.CONFIGS,
            lambda x, cfg, t=transpose: mf.quantize_fp8_weight(x, transpose=t, config=cfg),
            lambda x, out, t=transpose: same_fp8(out, ref.quantize_fp8_weight(x, transpose=t)),
            elements * 3 + (tokens // FP8_BLOCK) * (hidden // FP8_BLOCK) * 4)
    return [cases[k] for k in kernels]


def random_inputs(tokens: int, hidden: int, gen) -> list:
    """BUFFERS fresh random BF16 [T, H], values spread over 2^16 so that scales vary."""
    import torch

    inputs = []
    for _ in range(BUFFERS):
        x = torch.randn(tokens, hidden, device="cuda", generator=gen)
        x *= torch.exp2(torch.randint(-8, 8, (tokens, hidden), device="cuda", generator=gen).float())
        inputs.append(x.bfloat16())
        del x
    return inputs


def median_ms(fn, inputs: list, repeats: int, batch: int = 10, warmup: int = 3) -> float:
    """Median over `repeats` of the per-call time of `batch` calls, CUDA events; each batch waits
    behind a GPU sleep long enough for the host to queue it whole."""
    import torch

    for i in range(warmup):
        fn(inputs[i % len(inputs)])
    torch.cuda.synchronize()
    times = []
    for r in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(10_000_000)  # ~5 ms at H200 clocks: more than the host needs to queue the batch
        start.record()
        for i in range(batch):
            fn(inputs[(r * batch + i) % len(inputs)])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / batch)
    return statistics.median(times)


def copy_gbps(tokens: int, hidden: int, inputs: list, args) -> float:
    """The ceiling: copying each input (BF16 [T, H]) into a second buffer, read + write."""
    import torch

    out = torch.empty_like(inputs[0])
    ms = median_ms(lambda x: out.copy_(x), inputs, args.repeats, args.batch, args.warmup)
    return 2 * tokens * hidden * 2 / (ms * 1e-3) / 1e9


def record_fused_against_separate(recorder: Recorder, default_ms: dict, tokens: int, hidden: int) -> None:
    """Where rows, cols and both ran: the fused quantizer's time at its default against the two
    separate launches' (each at its default), one row (ratio < 1: the fused one is faster)."""
    separate = ("quantize_fp8_rows", "quantize_fp8_cols_ragged")
    fused = "quantize_fp8_rows_and_cols_ragged"
    if fused not in default_ms or not all(name in default_ms for name in separate):
        return
    separate_ms = sum(default_ms[name] for name in separate)
    recorder.add(fused, "time", default_ms[fused], "ms", SEPARATE, separate_ms, tokens=tokens, hidden=hidden,
                 better="lower")
    print(f"  {fused} {default_ms[fused]:.3f} ms against {separate_ms:.3f} ms for the two separate launches "
          f"({default_ms[fused] / separate_ms:.3f}x)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="16384x7168", help="comma-separated TxH list (default 16384x7168)")
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"comma-separated subset of {','.join(KERNELS)}")
    parser.add_argument("--experts", type=int, default=EXPERTS, help="experts of the ragged column case")
    parser.add_argument("--repeats", type=int, default=20, help="timed batches per config (median)")
    parser.add_argument("--batch", type=int, default=10, help="calls per timed batch")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls per config first")
    parser.add_argument("--no-check", action="store_true", help="skip the bit-exactness check against the reference")
    args = parser.parse_args(argv)
    kernels = args.kernels.split(",")
    unknown = set(kernels) - set(KERNELS)
    if unknown:
        parser.error(f"unknown kernels {sorted(unknown)}; choose from {','.join(KERNELS)}")

    import torch

    if not torch.cuda.is_available():
        print("bench_quantizers needs a CUDA GPU", file=sys.stderr)
        return 2
    recorder = Recorder("bench_quantizers", gpus=1, experts=args.experts)
    print(recorder.description())
    gen = torch.Generator(device="cuda").manual_seed(0)
    table, mismatches = [], []
    for size in args.sizes.split(","):
        tokens, hidden = (int(v) for v in size.split("x"))
        inputs = random_inputs(tokens, hidden, gen)
        copy = copy_gbps(tokens, hidden, inputs, args)
        print(f"\n{tokens} x {hidden}: device-to-device copy {copy:.0f} GB/s (read + write)")
        default_ms = {}  # case name -> ms at its default config
        for case in build_cases(tokens, hidden, kernels, args.experts):
            best = None
            for index, cfg in enumerate(case.configs):
                started = time.time()
                exact = None if args.no_check else case.check(inputs[0], case.run(inputs[0], cfg))
                ms = median_ms(lambda x: case.run(x, cfg), inputs, args.repeats, args.batch, args.warmup)
                gbps = case.bytes_moved / (ms * 1e-3) / 1e9
                fields = {"tokens": tokens, "hidden": hidden, "ms": ms, "default": index == 0,
                          "config": [cfg.block_rows, cfg.block_cols, cfg.num_warps]}
                if exact is not None:
                    fields["bit_exact"] = exact
                recorder.add(case.name, "bandwidth", gbps, "GB/s", COPY, copy, **fields)
                line = (f"{case.name:26s} {f'{tokens}x{hidden}':>11s} rows={cfg.block_rows:<4d} cols={cfg.block_cols:<4d} "
                        f"warps={cfg.num_warps:<3d} {ms:8.3f} ms {gbps:6.0f} GB/s {100 * gbps / copy:5.1f}%"
                        f"{'  default' if index == 0 else ''}{'' if exact in (None, True) else '  MISMATCH'}")
                print(line + f"   ({time.time() - started:.0f} s)", flush=True)
                table.append(line)
                if index == 0 and exact is not False:
                    default_ms[case.name] = ms
                if exact is False:
                    mismatches.append(line)
                if exact is not False and (best is None or gbps > best[0]):
                    best = (gbps, cfg)
            if best:
                print(f"  best {case.name}: {best[1]} at {100 * best[0] / copy:.1f}% of the copy")
        record_fused_against_separate(recorder, default_ms, tokens, hidden)
        del inputs
        torch.cuda.empty_cache()
    print("\n" + recorder.description())
    print("\n".join(table))
    recorder.write()
    if mismatches:  # the rows are written (bit_exact false), but the run fails
        print(f"\n{len(mismatches)} candidate(s) not bit-exact against the reference:\n" + "\n".join(mismatches))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
