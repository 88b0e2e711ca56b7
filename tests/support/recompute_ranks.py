"""What the recompute scenarios' ranks share (run by run_on_two_ranks, torch.cuda emulated on the
CPU): Megatron's parallel state, the CUDA RNG states its recompute asks for, its
CheckpointWithoutOutput without Transformer Engine, and a BF16 layer input and output gradient per
rank."""

import contextlib

import torch


@contextlib.contextmanager
def recompute_on_this_rank(rank: int, shape):
    """Yields (hidden, grad), both `shape` ([s, b, h]) in BF16, seeded by the rank."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_fp4.launch.workarounds import recompute_without_output_without_transformer_engine

    recompute_without_output_without_transformer_engine()  # no Transformer Engine here
    parallel_state.initialize_model_parallel()
    try:
        model_parallel_cuda_manual_seed(5)
        g = torch.Generator().manual_seed(rank)
        yield torch.randn(*shape, generator=g).bfloat16(), torch.randn(*shape, generator=g).bfloat16()
    finally:
        parallel_state.destroy_model_parallel()
