"""The MoE layer's distributed scenarios (tests/support/moe_layer_checks.py), one pytest item each:
on two GPUs (NCCL), and under the CPU emulation (gloo, torch.cuda emulated, reduced sizes) where no
GPU is present. Select one with -k, e.g. `-k cache-pipeline-vpp2`."""

import os

import pytest
import torch

from support.moe_layer_checks import SCENARIOS, shared_processes
from support.two_ranks import run_on_two_ranks

RUN = "support.moe_layer_checks.run_scenario"
RUN_SEVERAL = "support.moe_layer_checks.run_scenarios"
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
CI_EMULATED = {"layout-tp1-ep2-fp8", "fp8-experts", "recompute-experts", "cache-transformer-layer-bf16-experts",
               "cache-pipeline-vpp2-bf16-experts"}
EMULATE_ALL = os.environ.get("MEGATRON_FP4_EMULATE_ALL") == "1"


def _emulated(scenario: str) -> bool:
    return scenario in CI_EMULATED or EMULATE_ALL


@pytest.fixture(scope="module")
def emulated_failures(request, tmp_path_factory):
    """The emulated scenarios the session selected, run by pairs of CPU ranks that each take a
    share of them one after the other (torch, Megatron and Triton start once per pair, not once per
    scenario; moe_layer_checks.shared_processes says which share); returns failures(scenario) ->
    the ranks' failed assertions in it. A scenario that raises anything else stops its pair: it and
    the scenarios after it in that pair fail with that report."""
    selected = [item.callspec.params["scenario"] for item in request.session.items
                if item.originalname == "test_emulated_on_cpu" and _emulated(item.callspec.params["scenario"])]
    results = tmp_path_factory.mktemp("scenarios")
    stopped = {}
    for names in shared_processes(selected):
        try:
            run_on_two_ranks(RUN_SEVERAL, names, str(results), emulated=True,
                             timeout_s=EMULATED_TIMEOUT_S * len(names))
        except pytest.fail.Exception as error:
            stopped.update({name: str(error) for name in names})

    def failures(scenario: str) -> list:
        found = []
        for rank in range(2):
            path = results / f"{scenario}.rank{rank}.txt"
            report = path.read_text() if path.exists() else stopped.get(scenario, "did not run")
            if report != "ok":
                found.append(f"rank {rank}: {report}")
        return found

    return failures


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU emulation; with GPUs the real thing runs")
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_emulated_on_cpu(scenario, request):
    if not _emulated(scenario):
        pytest.skip("slow under the emulation: MEGATRON_FP4_EMULATE_ALL=1 runs it")
    failures = request.getfixturevalue("emulated_failures")(scenario)
    assert not failures, "\n".join(failures)
