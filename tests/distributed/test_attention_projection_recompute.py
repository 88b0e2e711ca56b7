"""The FP8 output projection keeps the fused attention's output by reference under Megatron's
mla_up_proj recompute and its own copy under core_attn recompute, and the MLA layer computes what
it computed before (tests/support/attention_projection_scenarios.py, on two emulated ranks or two
GPUs)."""

import torch

from support.two_ranks import run_on_two_ranks


def test_output_projection_under_mla_up_proj_and_core_attn_recompute():
    emulated = torch.cuda.device_count() < 2
    run_on_two_ranks("support.attention_projection_scenarios.run", emulated=emulated, timeout_s=300)
