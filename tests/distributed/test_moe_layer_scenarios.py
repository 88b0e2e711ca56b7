"""The MoE layer's distributed scenarios (tests/support/moe_layer_checks.py), one pytest item each:
on two GPUs (NCCL), and under the CPU emulation (gloo, torch.cuda emulated, reduced sizes) where no
GPU is present. Select one with -k, e.g. `-k cache-pipeline-vpp2`."""

import os

import pytest
import torch

from support.moe_layer_checks import SCENARIOS
from support.two_ranks import run_on_two_ranks

RUN = "support.moe_layer_checks.run_scenario"
# Wall-clock limits per scenario (both ranks), generous against the measured times.
GPU_TIMEOUT_S = 240
EMULATED_TIMEOUT_S = 900  # cache-pipeline-vpp2-fp8-experts: 116 s (every scenario emulated, 2 cores)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_on_two_gpus(scenario):
    run_on_two_ranks(RUN, scenario, False, emulated=False, timeout_s=GPU_TIMEOUT_S)


# Under the emulation a scenario takes 5-120 s on two cores: CI runs one of each kind (dispatch
# wire and gradient, FP8 experts, the cache through a whole layer and through the interleaved
# pipeline schedule); MEGATRON_FP4_EMULATE_ALL=1 runs every scenario.
CI_EMULATED = {"layout-tp1-ep2-fp8", "fp8-experts", "cache-transformer-layer-bf16-experts",
               "cache-pipeline-vpp2-bf16-experts"}
EMULATE_ALL = os.environ.get("MEGATRON_FP4_EMULATE_ALL") == "1"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU emulation; with GPUs the real thing runs")
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_emulated_on_cpu(scenario):
    if scenario not in CI_EMULATED and not EMULATE_ALL:
        pytest.skip("slow under the emulation: MEGATRON_FP4_EMULATE_ALL=1 runs it")
    run_on_two_ranks(RUN, scenario, True, emulated=True, timeout_s=EMULATED_TIMEOUT_S)
