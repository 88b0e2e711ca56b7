"""A per-process cap on PyTorch's CUDA allocator, from MEGATRON_FP4_GPU_MEMORY_CAP_GIB (which
`scripts/launch.py --enforce-memory-cap` sets from a config's cluster.gpu_memory_gib), so that a
small GPU can stand in for a config's memory budget. The cap bounds what the allocator reserves,
not the CUDA context or NCCL; going past it is Megatron's usual torch.OutOfMemoryError."""

import os

import torch

from ..run_config import GPU_MEMORY_CAP_ENV
from .refusal import refuse

# A config states the GPU's nominal size (80 for an "80 GB" H100), which the device reports a few %
# lower (79.2 GiB): within this margin the cap means "the whole GPU".
NOMINAL_SIZE_MARGIN = 1.03


def memory_fraction(cap_gib: float, total_bytes: int) -> float:
    """The share of a GPU's `total_bytes` that `cap_gib` GiB is (set_per_process_memory_fraction's unit);
    1.0 for a cap up to NOMINAL_SIZE_MARGIN above the GPU's size."""
    if not cap_gib > 0:  # also refuses NaN
        raise ValueError(f"the cap must be a positive number of GiB, got {cap_gib}")
    cap_bytes = cap_gib * 2**30
    if cap_bytes > NOMINAL_SIZE_MARGIN * total_bytes:
        raise ValueError(f"a {cap_gib:g} GiB cap is more than this GPU's {total_bytes / 2**30:.1f} GiB")
    return min(cap_bytes / total_bytes, 1.0)


def apply_memory_cap(local_rank: int) -> None:
    """With GPU_MEMORY_CAP_ENV set, cap PyTorch's allocator on this process's GPU; call it before the
    first CUDA allocation."""
    text = os.environ.get(GPU_MEMORY_CAP_ENV)
    if not text:
        return
    if not torch.cuda.is_available():
        refuse(f"{GPU_MEMORY_CAP_ENV}={text} caps CUDA memory, but no CUDA GPU is visible.")
    total_bytes = torch.cuda.get_device_properties(local_rank).total_memory
    try:
        cap_gib = float(text)
        fraction = memory_fraction(cap_gib, total_bytes)
    except ValueError as err:
        refuse(f"{GPU_MEMORY_CAP_ENV}={text}: {err}.")
    torch.cuda.set_device(local_rank)  # the GPU Megatron picks later; keeps this rank's context off GPU 0
    torch.cuda.set_per_process_memory_fraction(fraction, local_rank)
    whole = " (its nominal size: the whole GPU)" if fraction == 1.0 else ""
    print(f"rank {os.environ.get('RANK', '0')}: capping this process's CUDA memory at {cap_gib:g} GiB of "
          f"{total_bytes / 2**30:.1f} GiB{whole} (GPU {local_rank}, {GPU_MEMORY_CAP_ENV})", flush=True)
