"""Checkpoints at model level: FP4 dispatch + FP8 experts and stock Megatron load each other's
distributed checkpoints and continue with the same loss, a resumed FP4 run continues bit for bit,
and the distributed optimizer's parameter-ordered format is refused with its fix. One pytest item
per scenario (tests/support/checkpoint_scenarios.py), on two gloo ranks with torch.cuda emulated."""

import pytest
import torch

from support.two_ranks import run_on_two_ranks

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU emulation of two ranks")
TIMEOUT_S = 400
SCENARIOS = "support.checkpoint_scenarios.run"


def test_plugin_saves_stock_loads():
    run_on_two_ranks(SCENARIOS, "cross_load", True, emulated=True, timeout_s=TIMEOUT_S)


def test_stock_saves_plugin_loads():
    run_on_two_ranks(SCENARIOS, "cross_load", False, emulated=True, timeout_s=TIMEOUT_S)


def test_resumed_plugin_run_is_bit_identical():
    run_on_two_ranks(SCENARIOS, "resume", emulated=True, timeout_s=TIMEOUT_S)


def test_bucket_space_optimizer_format_refused_fix_accepted():
    run_on_two_ranks(SCENARIOS, "bucket_format", emulated=True, timeout_s=TIMEOUT_S)
