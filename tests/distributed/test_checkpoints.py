"""Checkpoints at model level: FP4 dispatch + FP8 experts and stock Megatron load each other's
distributed checkpoints and continue with the same loss, a resumed FP4 run continues bit for bit,
and the distributed optimizer's parameter-ordered format is refused with its fix. Through Megatron's
training-loop save_checkpoint / load_checkpoint, as users move between runs: a stock checkpoint in
that format gives FP8 experts its weights (--finetune, --no-load-optim) and its optimizer state is
refused in one sentence, a dispatch-only run resumes with FP8 experts, and EP 2 <-> EP 1. One pytest
item per scenario (tests/support/checkpoint_scenarios.py), on two gloo ranks with torch.cuda
emulated; items share process pairs: the resume and the FP4 -> stock load one FP4 saver run
(`plugin_saver`), the format refusal and the moves between runs another (`formats_and_moves`)."""

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


@pytest.fixture(scope="module")
def formats_and_moves_problems(tmp_path_factory):
    """Per rank, the problems found by case of one process pair that runs the bucket-format
    scenario and the moves between runs through Megatron's save_checkpoint / load_checkpoint."""
    results = tmp_path_factory.mktemp("formats_and_moves")
    run_on_two_ranks(SCENARIOS, "formats_and_moves", str(results), emulated=True, timeout_s=TIMEOUT_S)
    return [json.loads((results / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_bucket_space_optimizer_format_refused_fix_accepted(formats_and_moves_problems):
    _assert_none(formats_and_moves_problems, "bucket_format")


def test_stock_checkpoint_in_default_format_gives_fp8_experts_its_weights(formats_and_moves_problems):
    """--finetune and --no-load-optim: weights bit for bit, fp32 main weights made from them."""
    _assert_none(formats_and_moves_problems, "weights_only")


def test_default_format_optimizer_state_refused_in_one_sentence(formats_and_moves_problems):
    _assert_none(formats_and_moves_problems, "optimizer_refused")


def test_stock_resave_fully_reshardable_carries_optimizer_state_to_fp8_experts(formats_and_moves_problems):
    """The refusal's advice works: every weight, main weight and Adam state bit for bit."""
    _assert_none(formats_and_moves_problems, "resave_carries_optimizer")


def test_dispatch_only_checkpoint_resumes_with_fp8_experts(formats_and_moves_problems):
    _assert_none(formats_and_moves_problems, "dispatch_then_fp8_experts")


def test_fp8_experts_checkpoint_saved_at_ep2_loads_at_ep1(formats_and_moves_problems):
    _assert_none(formats_and_moves_problems, "ep2_to_ep1")


def test_fp8_experts_checkpoint_saved_at_ep1_loads_at_ep2(formats_and_moves_problems):
    _assert_none(formats_and_moves_problems, "ep1_to_ep2")
