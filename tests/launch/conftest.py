"""Fixtures the launch tests share."""

import pytest
import torch
from megatron.core import parallel_state


@pytest.fixture
def one_rank():
    """A one-process gloo group with Megatron's parallel state (layer specs ask for the pipeline rank)."""
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


@pytest.fixture(autouse=True)
def no_census_after_the_test():
    """A test that parses our flags in this process leaves no start-up census hooks behind (they
    would count, and may refuse, the next test's model)."""
    yield
    from megatron_fp4.launch import census_watch

    census_watch.stop()
