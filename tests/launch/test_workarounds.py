"""launch/workarounds.py: megatron-core 0.19.2's recompute without output (--recompute-modules
layernorm) asks Transformer Engine for its FP8 state even in BF16 runs; without Transformer Engine
the launcher builds those checkpoints with fp8 off."""

import pytest
import torch
from megatron.core.tensor_parallel import random as megatron_random

from megatron_fp4.launch import workarounds

pytestmark = pytest.mark.skipif(megatron_random.HAVE_TE, reason="the fix applies without Transformer Engine only")


def _checkpointed_square(checkpoint) -> torch.Tensor:
    """The checkpoint's forward (where the NameError was); its recompute needs CUDA RNG states."""
    x = torch.arange(4.0, requires_grad=True)
    return megatron_random.CheckpointWithoutOutputFunction.apply(lambda t: t * t, checkpoint, x)


def test_layernorm_recompute_runs_without_transformer_engine(monkeypatch):
    # megatron-core's own __init__ (another test in this process may have applied the fix already);
    # whatever was there is restored after the test.
    init = megatron_random.CheckpointWithoutOutput.__init__
    monkeypatch.setattr(megatron_random.CheckpointWithoutOutput, "__init__", getattr(init, "__wrapped__", init))
    with pytest.raises(NameError, match="FP8GlobalStateManager"):  # megatron-core's own, unfixed
        _checkpointed_square(megatron_random.CheckpointWithoutOutput())
    workarounds.recompute_without_output_without_transformer_engine()
    patched = megatron_random.CheckpointWithoutOutput.__init__
    workarounds.recompute_without_output_without_transformer_engine()  # once only
    assert megatron_random.CheckpointWithoutOutput.__init__ is patched
    checkpoint = megatron_random.CheckpointWithoutOutput()
    assert checkpoint.fp8 is False and checkpoint.ctx is None
    assert torch.equal(_checkpointed_square(checkpoint), torch.arange(4.0) ** 2)
    assert checkpoint.ctx is not None and checkpoint.ctx.fp8 is False  # kept for the recompute
