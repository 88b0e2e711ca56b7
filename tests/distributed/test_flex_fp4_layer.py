"""The FP4 dispatch through the flex dispatcher (DeepEP backend) on two gloo ranks with torch.cuda
emulated, through the project's DeepEP stand-in (tests/support/flex_layer_checks.py says what each
scenario claims). All scenarios run in one pair of rank processes."""

import pytest
import torch

from support.two_ranks import run_on_two_ranks

SCENARIO_NAMES = ["bf16-experts", "shared-expert", "shared-expert-overlap", "fp8-experts", "wire", "cache-bf16-experts",
                  "cache-fp8-experts", "cache-transformer-layer-fp8-experts"]
TIMEOUT_S = 600


@pytest.fixture(scope="module")
def failures(tmp_path_factory):
    """failures(scenario) -> the ranks' failed assertions in it (a scenario that raises anything else
    stops the pair: it and those after it fail with that report)."""
    results = tmp_path_factory.mktemp("flex")
    stopped = None
    try:
        run_on_two_ranks("support.flex_layer_checks.run_scenarios", SCENARIO_NAMES, str(results), emulated=True,
                         timeout_s=TIMEOUT_S)
    except pytest.fail.Exception as error:
        stopped = str(error)

    def of(scenario):
        found = []
        for rank in range(2):
            path = results / f"{scenario}.rank{rank}.txt"
            report = path.read_text() if path.exists() else (stopped or "did not run")
            if report != "ok":
                found.append(f"rank {rank}: {report}")
        return found

    return of


@pytest.mark.skipif(torch.cuda.is_available(), reason="the emulated gloo ranks run on CPU machines")
@pytest.mark.parametrize("scenario", SCENARIO_NAMES)
def test_flex_fp4_layer(scenario, failures):
    found = failures(scenario)
    assert not found, "\n".join(found)
