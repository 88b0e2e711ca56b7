"""The experts' FP8 weights are quantized once per optimizer step and never used stale, inside
Megatron's DDP and distributed optimizer, with and without --overlap-param-gather
(tests/support/weight_cache_scenarios.py), on two gloo ranks with torch.cuda emulated."""

import pytest
import torch

from support.two_ranks import run_on_two_ranks

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU emulation of two ranks")


def test_weights_quantized_once_per_step_never_stale_with_overlap_param_gather():
    # The harder of the two settings (the new weights arrive in the next forward's pre-hooks); one
    # emulated run costs ~2 minutes of CI, so the plain setting is left to the unit tests.
    run_on_two_ranks("support.weight_cache_scenarios.run", True, emulated=True, timeout_s=400)
