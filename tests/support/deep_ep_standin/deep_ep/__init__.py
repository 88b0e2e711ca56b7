"""A project-written stand-in for DeepEP's Python API, normal (high-throughput) mode only, over
torch.distributed all-to-all: for running Megatron-Core's flex token dispatcher with its DeepEP
backend on CPU ranks under gloo. buffer.py says what it mirrors of DeepEP v1.2.1 and where it
differs. Importable as `deep_ep` once tests/support/deep_ep_standin is on sys.path
(tests/support/deep_ep_on_cpu.install()). Exports what Megatron imports (Buffer, and EventHandle /
EventOverlap from deep_ep.utils); there is no HybridEPBuffer, so Megatron's HybridEP backend stays
unavailable."""

from .buffer import Buffer, Config
from .utils import EventHandle, EventOverlap

__version__ = "1.2.1"  # the DeepEP release whose behaviour this follows (its setup.py at tag v1.2.1)

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "__version__"]
