"""Fixtures of the single-rank module tests."""

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection


@pytest.fixture
def model_parallel():
    """Megatron's parallel state on one rank (NCCL with a GPU, gloo without); its process groups."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    try:
        yield get_default_pg_collection()
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
