"""Megatron's parallel state on a process group of one rank (gloo on the CPU, NCCL with CUDA), for
tests that build Megatron modules in the pytest process."""

import contextlib

import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection


@contextlib.contextmanager
def one_rank_parallel_state():
    """Yields Megatron's default process-group collection; everything is torn down on exit."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel()
        try:
            yield get_default_pg_collection()
        finally:
            parallel_state.destroy_model_parallel()
    finally:
        torch.distributed.destroy_process_group()
