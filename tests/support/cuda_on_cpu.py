"""torch.cuda on the CPU, for running GPU-only Megatron code paths (its MoE layer and pipeline
schedules call CUDA streams, events, RNG and device="cuda" factories) in a CPU test process.

Import it first, in a process of its own (it patches torch globally; never in the pytest
process): streams and events become no-ops, "cuda" devices the CPU, the CUDA RNG the CPU default
generator. Triton kernels run in the interpreter, our FP8 GEMMs in an fp32 emulation
(support/scaled_mm_on_cpu.py). What it cannot show: stream ordering, NCCL, the numerics of
CUDA-only ops."""

import contextlib
import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402


class _Stream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, event=None):
        return event or _Event()

    def synchronize(self):
        pass

    def query(self):
        return True

    def __eq__(self, other):
        return isinstance(other, _Stream)

    def __hash__(self):
        return 0


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


class _Generator(torch.Generator):
    def __new__(cls, device="cpu"):
        return super().__new__(cls, "cpu")


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # a device index


def _cpu_factory(factory):
    """factory with device="cuda..." given as a keyword made "cpu"."""
    def on_cpu(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs = dict(kwargs, device="cpu")
        return factory(*args, **kwargs)

    return on_cpu


def _cpu_move(move):
    """Tensor.to / Module.to, where a positional device (a string, torch.device or index) also counts."""
    def on_cpu(self, *args, **kwargs):
        return _cpu_factory(move)(self, *("cpu" if _is_cuda(a) else a for a in args), **kwargs)

    return on_cpu


def install() -> None:
    from support import interpreter_speedup

    interpreter_speedup.install()  # every emulated process runs the Triton kernels interpreted
    cuda = torch.cuda
    # One function object per patched name: torch.compile's tables refuse one object under two names.
    def nothing(*args, **kwargs):
        return None

    def patch(owner, name, function):
        setattr(owner, name, lambda *args, **kwargs: function(*args, **kwargs))

    torch.Generator = _Generator
    cuda.Stream, cuda.Event = _Stream, _Event
    for name in ("current_stream", "default_stream"):
        patch(cuda, name, lambda *args, **kwargs: _Stream())
    patch(cuda, "stream", lambda *args, **kwargs: contextlib.nullcontext())
    for name in ("synchronize", "set_device", "empty_cache", "reset_peak_memory_stats", "manual_seed_all"):
        patch(cuda, name, nothing)
    for name in ("memory_allocated", "max_memory_allocated"):
        patch(cuda, name, lambda *args, **kwargs: 0)
    patch(cuda, "current_device", lambda: 0)
    patch(cuda, "device_count", lambda: 2)
    patch(cuda, "is_current_stream_capturing", lambda: False)
    patch(cuda, "get_device_capability", lambda *args, **kwargs: (9, 0))
    for name in ("range_push", "range_pop"):
        patch(cuda.nvtx, name, nothing)
    for owner in (cuda, cuda.random):
        patch(owner, "get_rng_state", lambda *args, **kwargs: torch.get_rng_state())
        patch(owner, "set_rng_state", lambda state, *args, **kwargs: torch.set_rng_state(state))
    patch(cuda, "manual_seed", lambda seed: torch.default_generator.manual_seed(seed))
    for name in ("pin_memory", "cuda"):
        patch(torch.Tensor, name, lambda self, *args, **kwargs: self)
    patch(torch.Tensor, "record_stream", nothing)
    patch(torch.nn.Module, "cuda", lambda self, *args, **kwargs: self)
    torch.Tensor.to = _cpu_move(torch.Tensor.to)
    torch.nn.Module.to = _cpu_move(torch.nn.Module.to)
    for name in ("zeros", "empty", "ones", "full", "randn", "rand", "randint", "randperm", "tensor", "as_tensor",
                 "arange", "linspace", "empty_like", "zeros_like", "ones_like", "full_like", "randn_like",
                 "rand_like", "empty_strided", "eye"):
        setattr(torch, name, _cpu_factory(getattr(torch, name)))
    for name in ("new_zeros", "new_empty", "new_ones", "new_full", "new_tensor"):  # positional ints are sizes
        setattr(torch.Tensor, name, _cpu_factory(getattr(torch.Tensor, name)))

    # Megatron's checkpoint saves and restores the CUDA RNG state through its own helpers.
    import megatron.core.tensor_parallel.random as megatron_random

    megatron_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    megatron_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()

    # The dispatcher's device-to-host copy of its splits yields numpy arrays only for CUDA tensors;
    # emulated they would stay tensors, which all_to_all_single rejects as split sizes.
    import megatron.core.transformer.moe.token_dispatcher as megatron_dispatcher

    to_host = megatron_dispatcher.maybe_move_tensor_to_cpu
    megatron_dispatcher.maybe_move_tensor_to_cpu = lambda tensor, as_numpy=False, record_stream=False: (
        tensor.numpy() if as_numpy and torch.is_tensor(tensor) else to_host(tensor, as_numpy, record_stream))

    from support import scaled_mm_on_cpu

    scaled_mm_on_cpu.install()
