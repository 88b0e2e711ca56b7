"""Checkpoints at model level: FP4 dispatch + FP8 experts and stock Megatron load each other's
distributed checkpoints and continue with the same loss, a resumed FP4 run continues bit for bit,
and the distributed optimizer's parameter-ordered format is refused with its fix. One pytest item
per scenario (tests/support/checkpoint_scenarios.py), on two gloo ranks with torch.cuda emulated;
the resume and the FP4 -> stock load share one FP4 saver run (one process pair, `plugin_saver`)."""

import json

import pytest
import torch

from support.two_ranks import run_on_two_ranks

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU emulation of two ranks")
TIMEOUT_S = 400
SCENARIOS = "support.checkpoint_scenarios.run"


@pytest.fixture(scope="module")
def plugin_saver_problems(tmp_path_factory):
    """Per rank, the problems found by scenario ("resume", "cross_load") of one FP4 saver run
    loaded by an FP4 run and by a stock run."""
    results = tmp_path_factory.mktemp("plugin_saver")
    run_on_two_ranks(SCENARIOS, "plugin_saver", str(results), emulated=True, timeout_s=TIMEOUT_S)
    return [json.loads((results / f"rank{rank}.json").read_text()) for rank in range(2)]


def _assert_none(problems_by_rank, scenario):
    found = [f"rank {rank}: {problem}" for rank, problems in enumerate(problems_by_rank)
             for problem in problems[scenario]]
    assert not found, "\n".join(found)


def test_plugin_saves_stock_loads(plugin_saver_problems):
    _assert_none(plugin_saver_problems, "cross_load")


def test_stock_saves_plugin_loads():
    run_on_two_ranks(SCENARIOS, "cross_load", False, emulated=True, timeout_s=TIMEOUT_S)


def test_resumed_plugin_run_is_bit_identical(plugin_saver_problems):
    _assert_none(plugin_saver_problems, "resume")


def test_bucket_space_optimizer_format_refused_fix_accepted():
    run_on_two_ranks(SCENARIOS, "bucket_format", emulated=True, timeout_s=TIMEOUT_S)
