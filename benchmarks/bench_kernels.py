#!/usr/bin/env python3
"""Benchmark the MXFP4 / FP8 kernels on a CUDA GPU against the copy ceiling and torch.compile.

For each size and kernel: median time (triton.testing.do_bench, which flushes L2 before every
call), effective GB/s counting every input read once and every output written once, that as a
share of a device-to-device copy measured in this process, and the speedup over the reference
implementation (plain torch ops) compiled with torch.compile. Inputs are random, never zeros,
and rotate among enough buffers to exceed L2 several times over. Appends one "bandwidth" row per
kernel and size (reference: the copy) and one "time" row where the compiled baseline ran
(reference: its time) to benchmarks/results/bench_kernels.jsonl.

    python -m benchmarks.bench_kernels                 # the full table
    python -m benchmarks.bench_kernels --sweep         # also try tile configs at 16384 x 7168
    python -m benchmarks.bench_kernels --sizes 32768x4096 --kernels swiglu_backward,swiglu_backward_dequantized
"""

import argparse
import itertools
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch
import triton
import triton.testing

import megatron_fp4 as mf
from megatron_fp4 import reference as ref
from megatron_fp4.formats import FP8_BLOCK, mxfp4_wire_bytes_per_row
from megatron_fp4.kernels import TileConfig, fp8_quantize, fp8_quantize_cols, fp8_quantize_weight
from benchmarks.common import ragged_counts
from benchmarks.rows import Recorder

ROTATE_BYTES = 1 << 30  # inputs rotate over at least 1 GiB (H200 L2: 60 MB)
SIZES = [(4096, 7168), (16384, 7168), (65536, 7168), (4096, 2048), (16384, 2048), (65536, 2048)]
EXPERTS = 32
COPY = "device-to-device copy (read + write)"


@dataclass
class Case:
    """One kernel at one size: how to build an input, run it, and count its bytes."""

    name: str
    make_input: Callable[[torch.Tensor], object]  # from a random bf16 [T, H]
    run: Callable[[object, Optional[TileConfig]], object]
    baseline: Optional[Callable[[object], object]]  # None: no compiled composite to compare with
    bytes_moved: Callable[[int, int], int]


def uniform_counts(tokens: int, experts: int) -> torch.Tensor:
    counts = torch.full((experts,), tokens // experts, dtype=torch.long)
    counts[-1] += tokens - int(counts.sum())
    return counts


_eager_segment = ref.fp8_columns_of_segment


def compiled(fn):
    return torch.compile(fn, dynamic=True)


def build_cases(tokens: int, hidden: int) -> List[Case]:
    wire = mxfp4_wire_bytes_per_row(hidden)
    capacity = ref.colwise_capacity(tokens, EXPERTS)
    ragged = ragged_counts(tokens, EXPERTS, seed=tokens + hidden)
    uniform = uniform_counts(tokens, EXPERTS)
    quantize_ref = compiled(ref.quantize_mxfp4)
    dequantize_ref = compiled(ref.dequantize_mxfp4)
    rows_ref = compiled(ref.mxfp4_to_fp8_rows)
    fp8_ref = compiled(ref.quantize_fp8_rows)
    fp8_dequant_ref = compiled(ref.dequantize_fp8)
    weight_ref = compiled(ref.quantize_fp8_weight)
    ragged_dev = ragged.cuda()
    # Inductor cannot compile the whole ragged reference with dynamic shapes (its output size
    # depends on the expert count); compile the per-expert step, which does all the element work.
    ref.fp8_columns_of_segment = compiled(_eager_segment)
    cols_ref = ref.mxfp4_to_fp8_cols

    def cols_case(name, counts):
        counts_dev = counts.cuda()
        return Case(
            name,
            lambda x: mf.quantize_mxfp4(x),
            lambda q, cfg: mf.mxfp4_to_fp8_cols(q, counts_dev, check_counts=False, **_cfg(cfg)),
            lambda q: cols_ref(q, counts.tolist()),
            lambda t, h: t * wire + h * capacity + (capacity // FP8_BLOCK) * h * 4,
        )

    return [
        Case("quantize_mxfp4", lambda x: x, lambda x, cfg: mf.quantize_mxfp4(x, **_cfg(cfg)), quantize_ref,
             lambda t, h: t * h * 2 + t * wire),
        Case("dequantize_mxfp4", lambda x: mf.quantize_mxfp4(x), lambda q, cfg: mf.dequantize_mxfp4(q, **_cfg(cfg)),
             dequantize_ref, lambda t, h: t * wire + t * h * 2),
        Case("mxfp4_to_fp8_rows", lambda x: mf.quantize_mxfp4(x),
             lambda q, cfg: mf.mxfp4_to_fp8_rows(q, **_cfg(cfg)), rows_ref,
             lambda t, h: t * wire + t * h + t * (h // FP8_BLOCK) * 4),
        cols_case("mxfp4_to_fp8_cols", uniform),
        cols_case("mxfp4_to_fp8_cols_ragged", ragged),
        Case("quantize_fp8_rows", lambda x: x, lambda x, cfg: mf.quantize_fp8_rows(x, **_cfg(cfg)), fp8_ref,
             lambda t, h: t * h * 2 + t * h + t * (h // FP8_BLOCK) * 4),
        Case("dequantize_fp8", lambda x: mf.quantize_fp8_rows(x), lambda t8, cfg: mf.dequantize_fp8(t8, **_cfg(cfg)),
             fp8_dequant_ref, lambda t, h: t * h + t * (h // FP8_BLOCK) * 4 + t * h * 2),
        # Issue 4's experts: the BF16 -> FP8 column quantizer (wgrad gradient operand, ragged experts)
        # and the 128x128 weight quantizer, plain (fprop) and transposed (dgrad); [T, H] read as a weight.
        Case("quantize_fp8_cols_ragged", lambda x: x,
             lambda x, cfg: mf.quantize_fp8_cols(x, ragged_dev, check_counts=False, **_cfg(cfg)),
             None,  # the reference loops over experts in Python: no compiled baseline
             lambda t, h: t * h * 2 + h * capacity + (capacity // FP8_BLOCK) * h * 4),
        Case("quantize_fp8_weight", lambda x: x, lambda w, cfg: mf.quantize_fp8_weight(w, **_cfg(cfg)), weight_ref,
             lambda t, h: t * h * 3 + (t // FP8_BLOCK) * (h // FP8_BLOCK) * 4),
        Case("quantize_fp8_weight_t", lambda x: x,
             lambda w, cfg: mf.quantize_fp8_weight(w, transpose=True, **_cfg(cfg)),
             lambda w: weight_ref(w, True), lambda t, h: t * h * 3 + (t // FP8_BLOCK) * (h // FP8_BLOCK) * 4),
        *swiglu_cases(),
    ]


def swiglu_cases() -> List[Case]:
    """The experts' SwiGLU kernels, [T, H] read as fc1_out (H = 2 x FFN): the forward writing fc2_in's FP8
    rows and either the MXFP4 copies backward reads (the FP4 recipe) or its BF16 values (the baseline);
    the backward from BF16 fc1_out and from its MXFP4 copy (dequantized first: two kernels). Bytes: what each reads and writes once (probs and the FP8 scales included)."""
    from megatron_fp4.kernels.swiglu import swiglu_with_probs_backward
    from megatron_fp4.kernels.swiglu_forward import swiglu_quantized

    def with_probs(x):
        return x, torch.rand(x.shape[0], device=x.device)

    def backward_args(fc1_out, x):
        return fc1_out, torch.rand(x.shape[0], device=x.device), torch.randn_like(x[:, : x.shape[1] // 2])

    def fp8_rows_bytes(t, ffn):
        return t * ffn + t * (ffn // FP8_BLOCK) * 4

    def backward_bytes(fc1_bytes):
        return lambda t, h: t * fc1_bytes(h) + t * (h // 2) * 2 + t * h * 2 + t * 8

    return [
        Case("swiglu_forward_mxfp4", with_probs,
             lambda a, cfg: swiglu_quantized(a[0], a[1], 0.0, torch.bfloat16, keep_values=False, mxfp4_rule="ceil"),
             None, lambda t, h: t * h * 2 + t * 4 + fp8_rows_bytes(t, h // 2) + t * mxfp4_wire_bytes_per_row(h // 2)
             + t * mxfp4_wire_bytes_per_row(h)),
        Case("swiglu_forward_values", with_probs,
             lambda a, cfg: swiglu_quantized(a[0], a[1], 0.0, torch.bfloat16, keep_values=True, mxfp4_rule=None),
             None, lambda t, h: t * h * 2 + t * 4 + fp8_rows_bytes(t, h // 2) + t * (h // 2) * 2),
        Case("swiglu_backward", lambda x: backward_args(x, x),
             lambda a, cfg: swiglu_with_probs_backward(*a, 0.0), None, backward_bytes(lambda h: h * 2)),
        Case("swiglu_backward_dequantized", lambda x: backward_args(mf.quantize_mxfp4(x), x),
             lambda a, cfg: swiglu_with_probs_backward(mf.dequantize_mxfp4(a[0]), *a[1:], 0.0), None,
             backward_bytes(mxfp4_wire_bytes_per_row)),
    ]


def _cfg(cfg: Optional[TileConfig]) -> Dict[str, TileConfig]:
    return {} if cfg is None else {"config": cfg}


def rotating_inputs(case: Case, tokens: int, hidden: int, gen: torch.Generator) -> list:
    count = max(2, -(-ROTATE_BYTES // (tokens * hidden * 2)))
    count = min(count, 8)
    inputs = []
    for _ in range(count):
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.float32, generator=gen)
        x = (x * torch.exp2(torch.randint(-8, 8, (tokens, hidden), device="cuda", generator=gen).float())).bfloat16()
        inputs.append(case.make_input(x))
        del x
    return inputs


def median_ms(fn, inputs) -> float:
    it = itertools.cycle(inputs)
    return triton.testing.do_bench(lambda: fn(next(it)), warmup=25, rep=100, return_mode="median")


def memory_ceilings() -> Dict[str, float]:
    """Bytes per second over 2 GiB: device-to-device copy (read + write, the ceiling every kernel
    is quoted against), and, to tell read-heavy from write-heavy kernels, a pure read (sum) and a
    pure write (fill)."""
    src = torch.randn(1 << 29, device="cuda")
    dst = torch.empty_like(src)
    nbytes = src.numel() * src.element_size()
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    read_ms = triton.testing.do_bench(lambda: src.sum(), warmup=25, rep=200, return_mode="median")
    write_ms = triton.testing.do_bench(lambda: dst.fill_(1.5), warmup=25, rep=200, return_mode="median")
    return {"copy": 2 * nbytes / (copy_ms * 1e-3), "read": nbytes / (read_ms * 1e-3),
            "write": nbytes / (write_ms * 1e-3)}


SWEEP = {
    "quantize_mxfp4": [TileConfig(r, c, w) for r, c, w in [(8, 16, 4), (4, 32, 4), (8, 32, 4), (16, 16, 4)]],
    "dequantize_mxfp4": [TileConfig(r, c, w) for r, c, w in
                         [(8, 16, 4), (8, 32, 4), (16, 32, 4), (16, 32, 8), (32, 32, 8), (8, 64, 8), (16, 64, 8)]],
    "mxfp4_to_fp8_rows": [TileConfig(r, c, w) for r, c, w in
                          [(8, 4, 4), (8, 8, 4), (4, 16, 4), (8, 16, 8), (4, 8, 4), (16, 16, 8)]],
    "mxfp4_to_fp8_cols": [TileConfig(128, c, w) for c, w in [(2, 4), (2, 8), (4, 4), (4, 8), (8, 8), (8, 16)]],
    # The FP8 quantizers' candidates live next to their kernels (benchmarks/bench_quantizers.py
    # sweeps them alone, faster).
    "quantize_fp8_rows": list(fp8_quantize.CONFIGS),
    "quantize_fp8_cols_ragged": list(fp8_quantize_cols.CONFIGS),
    "quantize_fp8_weight": list(fp8_quantize_weight.CONFIGS),
    "quantize_fp8_weight_t": list(fp8_quantize_weight.CONFIGS),
    "dequantize_fp8": [TileConfig(r, c, w) for r, c, w in [(8, 4, 4), (8, 8, 8)]],
}


def sweep(copy_bw: float, only: Optional[List[str]]) -> Dict[str, TileConfig]:
    tokens, hidden = 16384, 7168
    gen = torch.Generator(device="cuda").manual_seed(1)
    best = {}
    print(f"\n== tile sweep at {tokens} x {hidden} (% of copy) ==")
    for case in build_cases(tokens, hidden):
        # A kernel swept uniform stands for its ragged case, unless the ragged case has its own list.
        configs = SWEEP.get(case.name) or SWEEP.get(case.name.replace("_ragged", ""))
        uniform_twin = case.name.endswith("_ragged") and case.name not in SWEEP
        if not configs or uniform_twin or (only and case.name not in only):
            continue  # kernels without tile choices are timed as they are
        inputs = rotating_inputs(case, tokens, hidden, gen)
        results = []
        for cfg in configs:
            ms = median_ms(lambda i: case.run(i, cfg), inputs)
            pct = 100 * case.bytes_moved(tokens, hidden) / (ms * 1e-3) / copy_bw
            results.append((pct, cfg))
            print(f"  {case.name:28s} rows={cfg.block_rows:<4d} cols={cfg.block_cols:<3d} warps={cfg.num_warps:<3d} {pct:5.1f}%")
        best[case.name] = max(results, key=lambda r: r[0])[1]
        del inputs
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", nargs="?", const="all", default=None, metavar="KERNELS",
                        help="try several tile configs at 16384 x 7168 first (all kernels, or a comma-separated "
                        "list) and use the best of each in the table")
    parser.add_argument("--sizes", default=None, help="comma-separated TxH list, e.g. 16384x7168,4096x2048")
    parser.add_argument("--no-baseline", action="store_true", help="skip the torch.compile baselines")
    parser.add_argument("--kernels", default=None, help="comma-separated kernel (case) names; default: all")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels needs a CUDA GPU", file=sys.stderr)
        return 2
    recorder = Recorder("bench_kernels", gpus=1, experts=EXPERTS)
    sizes = SIZES if args.sizes is None else [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]

    if args.kernels is not None:
        unknown = set(args.kernels.split(",")) - {case.name for case in build_cases(*sizes[0])}
        if unknown:
            raise SystemExit(f"--kernels: no kernel named {sorted(unknown)}")
    ceilings = memory_ceilings()
    copy_bw = ceilings["copy"]
    print(recorder.description())
    print(f"device-to-device copy: {copy_bw / 1e9:.0f} GB/s (read + write); read only {ceilings['read'] / 1e9:.0f} "
          f"GB/s; write only {ceilings['write'] / 1e9:.0f} GB/s")
    only = None if args.sweep in (None, "all") else args.sweep.split(",")
    best = sweep(copy_bw, only) if args.sweep else {}
    if best:
        print("best configs:", {k: (c.block_rows, c.block_cols, c.num_warps) for k, c in best.items()})

    header = f"{'kernel':28s} {'tokens x hidden':>16s} {'ms':>8s} {'GB/s':>7s} {'% copy':>7s} {'vs compile':>10s}"
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for tokens, hidden in sizes:
        for case in build_cases(tokens, hidden):
            if args.kernels is not None and case.name not in args.kernels.split(","):
                continue
            started = time.time()
            inputs = rotating_inputs(case, tokens, hidden, gen)
            cfg = best.get(case.name) or best.get(case.name.replace("_ragged", ""))
            ms = median_ms(lambda i: case.run(i, cfg), inputs)
            gbps = case.bytes_moved(tokens, hidden) / (ms * 1e-3) / 1e9
            pct = 100 * gbps * 1e9 / copy_bw
            shape = {"tokens": tokens, "hidden": hidden, "config": _config_fields(cfg)}
            recorder.add(case.name, "bandwidth", gbps, "GB/s", COPY, copy_bw / 1e9, ms=ms, **shape)
            speedup = "n/a"
            if not args.no_baseline and case.baseline is not None:
                try:
                    base_ms = median_ms(case.baseline, inputs[:2])
                    speedup = f"{base_ms / ms:.1f}x"
                    recorder.add(case.name, "time", ms, "ms", "reference under torch.compile", base_ms, **shape)
                except Exception as exc:  # a baseline that does not compile is reported, not hidden
                    speedup = f"fail:{type(exc).__name__}"
            rows.append(f"{case.name:28s} {f'{tokens} x {hidden}':>16s} {ms:8.3f} {gbps:7.0f} {pct:6.1f}% "
                        f"{speedup:>10s}")
            print(rows[-1] + f"   ({time.time() - started:.0f} s)", flush=True)
            del inputs
            torch.cuda.empty_cache()
    print("\n" + recorder.description())
    print(f"copy ceiling {copy_bw / 1e9:.0f} GB/s (read only {ceilings['read'] / 1e9:.0f}, write only "
          f"{ceilings['write'] / 1e9:.0f}); {EXPERTS} experts for cols, a quarter empty in the ragged case; "
          f"cols timed with check_counts=False, the dispatcher's call")
    print(header)
    print("\n".join(rows))
    recorder.write()
    return 0


def _config_fields(cfg: Optional[TileConfig]) -> Optional[List[int]]:
    """A swept tile config as [block_rows, block_cols, num_warps]; None for the kernel's default."""
    return None if cfg is None else [cfg.block_rows, cfg.block_cols, cfg.num_warps]


if __name__ == "__main__":
    sys.exit(main())
