"""The project's DeepEP stand-in (tests/support/deep_ep_standin: DeepEP's normal-mode Python API
over torch.distributed all-to-all) on two gloo ranks with torch.cuda emulated: its Buffer
directly, and Megatron's flex MoE layer (DeepEP backend) through it against a stock alltoall
layer (tests/support/deep_ep_checks.py). Both scenarios run in one pair of rank processes."""

import pytest
import torch

from support.two_ranks import run_on_two_ranks

TIMEOUT_S = 300


@pytest.fixture(scope="module")
def failures(tmp_path_factory):
    """Runs every scenario in one pair of CPU ranks (Megatron and torch start once); a failed
    assertion stops the pair and is reported by the scenario it happened in and the ones after."""
    from support.deep_ep_checks import SCENARIOS

    try:
        run_on_two_ranks("support.deep_ep_checks.run_scenarios", list(SCENARIOS), emulated=True, timeout_s=TIMEOUT_S)
    except pytest.fail.Exception as error:
        return str(error)
    return None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the emulated gloo ranks run on CPU machines")
@pytest.mark.parametrize("scenario", ["buffer", "moe-layer"])
def test_deep_ep_standin(scenario, failures):
    if failures is not None:
        pytest.fail(failures)
