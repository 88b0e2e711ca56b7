"""The faster of a grouped GEMM's candidate tile configs, timed once per GEMM shape on the GPU.

Every tile config of the grouped FP8 GEMMs computes the same sums in the same order (the GPU tests hold
them bit for bit), so which one runs changes the speed, never the result. No config wins every shape:
on H200 the CUDA kernel won fc1's forward at 32 local experts by 10% and lost it at 8 by 8% to the
Triton kernel, which also won fc1's data gradient in every sweep (docs/kernels.md). So where a GEMM
has several candidates, its first call with a new shape runs each a few times and keeps the fastest
for the rest of the process. That first call waits for the GPU (one host sync per shape). Inside a
CUDA graph capture nothing can be timed: the first candidate (the static default) runs, and the
shape stays untimed until a call outside a capture.
"""

import contextlib
import threading
from dataclasses import dataclass
from typing import Callable, Dict, Hashable, Sequence, TypeVar

import torch

Tiles = TypeVar("Tiles", bound=Hashable)  # a GEMM's tile config (grouped_fp8_gemm.GemmTiles)
TIMED_RUNS = 3  # per candidate, after one untimed run (which also compiles it)


@dataclass(frozen=True)
class GemmShape:
    """What a choice is kept by: the GEMM, its device and sizes; rows to the next power of two (the
    routed rows vary a little from step to step)."""

    gemm: str
    device: torch.device
    n: int
    k: int
    experts: int
    rows_bucket: int
    out_dtype: torch.dtype

    @classmethod
    def of(cls, gemm: str, device: torch.device, rows: int, n: int, k: int, experts: int,
           out_dtype: torch.dtype) -> "GemmShape":
        return cls(gemm, device, n, k, experts, 1 << max(rows - 1, 0).bit_length(), out_dtype)


def gpu_ms(run: Callable[[], object]) -> float:
    """Milliseconds per call of `run` on the current stream: one untimed call, then TIMED_RUNS between
    two CUDA events."""
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(TIMED_RUNS):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / TIMED_RUNS


class TileChoices:
    """The chosen tiles per GemmShape, for this process."""

    def __init__(self, timer: Callable[[Callable[[], object]], float] = gpu_ms):
        self._timer = timer
        self._chosen: Dict[GemmShape, Hashable] = {}
        self._lock = threading.Lock()  # several threads may launch (one per GPU)

    def fastest(self, shape: GemmShape, candidates: Sequence[Tiles],
                run: Callable[[Tiles], object]) -> Tiles:
        """The candidate kept for `shape`; at the shape's first call, each candidate timed by running
        run(tiles) (which must only write the GEMM's output)."""
        if len(candidates) == 1:
            return candidates[0]
        with self._lock:
            chosen = self._chosen.get(shape)
        if chosen is not None:
            return chosen
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return candidates[0]
        # The events time the shape's device's current stream, where the kernels run.
        with torch.cuda.device(shape.device) if shape.device.type == "cuda" else contextlib.nullcontext():
            times = {tiles: self._timer(lambda tiles=tiles: run(tiles)) for tiles in candidates}
        chosen = min(times, key=times.get)
        with self._lock:
            self._chosen[shape] = chosen
        return chosen

    def chosen(self) -> Dict[GemmShape, Hashable]:
        """What was chosen so far (a copy): for benchmarks and logs."""
        with self._lock:
            return dict(self._chosen)

    def forget(self) -> None:
        with self._lock:
            self._chosen.clear()


CHOICES = TileChoices()
