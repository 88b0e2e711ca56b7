"""The FP8 linears that read a layernorm's output keep it by reference under Megatron's
--recompute-modules layernorm, and the layer computes exactly what it computes without that
recompute (tests/support/layernorm_recompute_scenarios.py, on two emulated ranks or two GPUs)."""

import torch

from support.two_ranks import run_on_two_ranks


def test_layernorm_recompute_keeps_the_readers_inputs_by_reference_and_changes_nothing():
    emulated = torch.cuda.device_count() < 2
    run_on_two_ranks("support.layernorm_recompute_scenarios.run", emulated=emulated, timeout_s=300)
