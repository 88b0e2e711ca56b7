"""The estimate as a table (one row per config, two for an fp4 config: the paper's recipe and what
the installed package delivers) or as JSON."""

import json
from pathlib import Path

from .core import GIB, Estimate

# The two memory rows of an fp4 config (the table's note and `estimate --help` say it alike).
FP4_MEMORY_ROWS = ("'recipe' = the paper's whole FP4 recipe (FP8 experts and FP8 linears, the expert activations, "
                   "every linear's saved input and the SwiGLU inputs kept in MXFP4 outside recomputed modules, one "
                   "FP8 copy of their weights for the step, dispatch cached for `moe` recompute); 'installed' = "
                   "what the config's flags switch on in this package (MXFP4 on the wire; --moe-fp4-experts fp8: "
                   "expert activations in MXFP4; --moe-fp4-linears fp8: FP8-saved linear inputs, MXFP4 with "
                   "--moe-fp4-storage all; their FP8 weight copy unless --moe-fp4-weights-per-use, W^T beside it "
                   "with --moe-fp4-keep-transposed-weights; the dispatch cache only with --moe-fp4-cache).")
COLUMNS = ("config", "prec", "fp4 memory", "recompute", "weights", "grads", "optim", "activ", "transient",
           "peak GiB", "device", "GPU GiB", "% GPU", "fits", "a2a GB/step")


def display_name(path: str) -> str:
    """A config's folder and file name (proxy/gpus2.yaml)."""
    p = Path(path)
    return f"{p.parent.name}/{p.name}"


def row(e: Estimate) -> list[str]:
    r = e.peak_rank
    fits = e.verdict or "-"
    percent = "-" if e.fraction is None else f"{100 * e.fraction:.1f}"
    mode = e.mode if e.precision.name == "fp4" else ""
    return [display_name(e.config), e.precision.name, mode, e.recompute.label(),
            f"{r.static.weights / GIB:.2f}", f"{r.static.grads / GIB:.2f}", f"{r.static.optimizer / GIB:.2f}",
            f"{r.activations / GIB:.2f}", f"{(r.transient + r.static.buffers) / GIB:.2f}",
            f"{e.peak_gib:.2f}", f"{e.device.total / GIB:.2f}", f"{e.device_peak_gib:.2f}", percent, fits,
            f"{e.a2a.total / 1e9:.1f}"]


def table(estimates: list[Estimate]) -> str:
    rows = [list(COLUMNS)] + [row(e) for e in estimates]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = []
    for n, r in enumerate(rows):
        cells = [c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    notes = [("GiB = 2^30 bytes, per GPU, on the pipeline rank with the largest peak; transient = the backward's working "
              "set plus persistent buffers (--detail lists them); peak = PyTorch's max allocated; "
              "device = CUDA context + NCCL + DeepEP buffers + the allocator's reserve (assumptions: docs/estimator.md); "
              "GPU GiB = peak + device, what a GPU monitor shows, which % GPU and fits compare with the GPU ('tight': "
              "fits only if the allocator gives its reserve back); a2a GB = 10^9 bytes the same GPU sends per step "
              "(dispatch + combine, forward + backward, recompute included).")]
    if any(e.precision.name == "fp4" for e in estimates):
        notes.append("fp4 memory: " + FP4_MEMORY_ROWS)
    overrides = {k: v for e in estimates for k, v in e.overrides.items()}
    if overrides:
        notes.append("overrides: " + ", ".join(f"{k}={v}" for k, v in overrides.items()))
    return "\n".join(lines + [""] + notes)


def detail(e: Estimate) -> str:
    r = e.peak_rank
    device = ", ".join(f"{k.replace('_', ' ')} {v / GIB:.2f}" for k, v in e.device.as_dict().items())
    lines = [f"{display_name(e.config)} ({e.precision.name}{', ' + e.mode if e.precision.name == 'fp4' else ''}): "
             f"peak rank {r.rank}, micro-batches held per chunk {r.held}, per-rank peaks GiB "
             + " ".join(f"{x.peak / GIB:.1f}" for x in e.ranks),
             f"  device-level rows, GiB: {device}",
             f"  persistent buffers, GiB (in the transient column): unfused attention's score buffer "
             f"{r.static.workspace / GIB:.2f}, cuBLAS workspaces and cached dummy weight gradients "
             f"{r.static.wgrad_buffers / GIB:.2f}",
             "  saved activations by tensor, GiB: one micro-batch of this rank's chunks | held at the peak"]
    for key, value in sorted(r.components.items(), key=lambda kv: -kv[1]):
        if value / GIB >= 0.0005:
            lines.append(f"    {key:32s} {value / GIB:8.3f} {r.held_components[key] / GIB:9.2f}")
    return "\n".join(lines)


def as_json(estimates: list[Estimate]) -> str:
    return json.dumps([e.as_dict() for e in estimates], indent=2)
