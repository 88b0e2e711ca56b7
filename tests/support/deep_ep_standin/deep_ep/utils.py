"""Events of the stand-in (see buffer.py for what the package mirrors).

DeepEP's EventHandle (a C++ class) records a CUDA event on the current stream when constructed,
and current_stream_wait() makes the current stream wait for it; its kernels run on a
communication stream of their own, so these events order that stream against the caller's. The
stand-in communicates on the caller's stream (torch.distributed.all_to_all_single), so its events
order nothing that is not ordered already: EventHandle records a real torch.cuda.Event where CUDA
is initialized (so a caller that waits on it waits on something real), and holds nothing on the
CPU, where waiting is a no-op. EventOverlap wraps one of them the way DeepEP's does, including the
`with` form (the current stream waits on leaving the block)."""

from typing import Any, Optional, Tuple

import torch


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class EventHandle:
    """An event recorded on the current stream at construction (nothing on the CPU)."""

    def __init__(self) -> None:
        self.event = None
        if _cuda_in_use():
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        """The current stream waits for the recorded event; a no-op without CUDA."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


class EventOverlap:
    """An optional EventHandle, plus tensors the caller wants kept alive until the event is
    waited on (extra_tensors; DeepEP offers it as a graph-safe substitute for record_stream)."""

    def __init__(self, event: Optional[EventHandle] = None,
                 extra_tensors: Optional[Tuple[torch.Tensor, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """The current stream waits for the event; like DeepEP, there must be one (async_finish)."""
        assert self.event is not None, "no event to wait for: the operation ran without async_finish"
        self.event.current_stream_wait()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self.event is not None:
            self.event.current_stream_wait()


__all__ = ["EventHandle", "EventOverlap"]
