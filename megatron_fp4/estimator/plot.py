"""`megatron-fp4 estimate --plot FILE.png`: each estimate row as one horizontal bar of its
device-level memory per GPU, stacked by part (weights, gradients, optimizer, activations,
transient, the device-level rows), against the GPU's memory, so that one picture shows which configurations (precisions, recompute scopes)
fit. Needs matplotlib, the package's optional extra `plot`: pip install 'megatron_fp4[plot]'."""

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .core import GIB, Estimate
from .report import display_name

# (part, colour); the parts sum to the device-level peak, as the table's columns do (transient
# includes the persistent buffers; device: CUDA context, NCCL, DeepEP, the allocator's reserve).
PARTS = (("weights", "#4c72b0"), ("gradients", "#55a868"), ("optimizer", "#c44e52"), ("activations", "#8172b2"),
         ("transient", "#ccb974"), ("device", "#8c8c8c"))
CAPACITY_COLOUR = "#222222"
# Formats matplotlib lists but cannot write without more software: pgf runs LaTeX (xelatex).
NEEDS_MORE_THAN_MATPLOTLIB = frozenset({"pgf"})


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


class PlotPathError(ValueError):
    """A --plot path that cannot be written (one sentence)."""


@dataclass(frozen=True)
class Bar:
    label: str
    parts: dict  # part -> GiB, in PARTS order
    capacity_gib: Optional[float]  # the config's cluster.gpu_memory_gib
    verdict: Optional[str] = None  # Estimate.verdict: fits, tight or OOM

    @property
    def peak_gib(self) -> float:
        return sum(self.parts.values())

    @property
    def fits(self) -> Optional[bool]:
        return None if self.verdict is None else self.verdict != "OOM"


def bar_of(e: Estimate) -> Bar:
    r = e.peak_rank
    mode = f", {e.mode}" if e.precision.name == "fp4" else ""
    label = f"{display_name(e.config)}\n{e.precision.name}{mode}, recompute {e.recompute.label()}"
    values = (r.static.weights, r.static.grads, r.static.optimizer, r.activations, r.transient + r.static.buffers,
              e.device.total)
    return Bar(label, {part: value / GIB for (part, _), value in zip(PARTS, values)}, e.gpu_memory_gib, e.verdict)


def matplotlib_figure_class():
    """matplotlib's Figure (no pyplot: no GUI backend, no global state), or PlotUnavailable."""
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise PlotUnavailable("--plot needs matplotlib: pip install 'megatron_fp4[plot]' (or matplotlib)") from err
    return Figure


def plot_formats() -> list[str]:
    """The file suffixes (without the dot) that plot() writes here; PlotUnavailable without matplotlib."""
    Figure = matplotlib_figure_class()
    return sorted(set(Figure().canvas.get_supported_filetypes()) - NEEDS_MORE_THAN_MATPLOTLIB)


def check_plot_path(path) -> Path:
    """Refuse, before any work, a path that plot() could not write: a missing or unwritable folder,
    a folder itself, a suffix that is not a format matplotlib writes (PlotPathError), or no
    matplotlib (PlotUnavailable)."""
    formats = plot_formats()
    path = Path(path)
    if path.is_dir():
        raise PlotPathError(f"--plot {path} is a folder: name a file in it, such as {path / 'memory.png'}")
    suffix = path.suffix[1:].lower()
    if suffix not in formats:
        found = f"not '.{suffix}'" if suffix else "and it has none"
        raise PlotPathError(f"--plot {path}: the file name must end in a format matplotlib writes "
                            f"({', '.join('.' + f for f in formats)}), {found}")
    folder = path.parent
    if not folder.is_dir():
        raise PlotPathError(f"--plot {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise PlotPathError(f"--plot {path}: the folder {folder} is not writable")
    return path


def plot(estimates: list[Estimate], path) -> Path:
    """Write the bars of `estimates` (top to bottom in their order) to `path` (its suffix picks the
    format: .png, .svg, .pdf)."""
    Figure = matplotlib_figure_class()
    bars = [bar_of(e) for e in estimates]
    figure = Figure(figsize=(11, 1.2 + 0.75 * len(bars)), layout="constrained")
    axes = figure.add_subplot()
    rows = range(len(bars))
    left = [0.0] * len(bars)
    for part, colour in PARTS:
        widths = [b.parts[part] for b in bars]
        axes.barh(rows, widths, left=left, height=0.6, color=colour, label=part)
        left = [x + w for x, w in zip(left, widths)]
    widest = max([b.peak_gib for b in bars] + [b.capacity_gib or 0 for b in bars])
    legend = "GPU memory"
    for row, b in zip(rows, bars):
        verdict = "" if b.verdict is None else f"  {b.verdict}"
        axes.text(b.peak_gib + 0.01 * widest, row, f"{b.peak_gib:.1f} GiB{verdict}", va="center", fontsize=8,
                  bbox={"facecolor": "white", "edgecolor": "none", "pad": 1}, zorder=3)
        if b.capacity_gib is not None:  # each config's own GPU: a mark across its bar
            axes.plot([b.capacity_gib] * 2, [row - 0.42, row + 0.42], color=CAPACITY_COLOUR, linestyle="--",
                      linewidth=1.5, label=legend)
            legend = None  # one legend entry
    axes.set_yticks(list(rows), [b.label for b in bars], fontsize=8)
    axes.invert_yaxis()  # the first config on top, as in the table
    axes.set_xlim(0, 1.15 * widest)
    axes.set_xlabel("GiB per GPU (2^30 bytes), pipeline rank with the largest peak")
    axes.set_title("megatron-fp4 estimate: device-level peak memory per GPU by part", fontsize=10)
    figure.legend(loc="outside lower center", ncols=len(PARTS) + 1, fontsize=8)
    axes.grid(axis="x", alpha=0.3)
    path = Path(path)
    figure.savefig(path, dpi=120)
    return path


__all__ = ["Bar", "PARTS", "PlotPathError", "PlotUnavailable", "bar_of", "check_plot_path", "matplotlib_figure_class",
           "plot", "plot_formats"]
