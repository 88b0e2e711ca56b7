"""The estimator under the flex dispatcher on DeepEP: a token crosses once per destination rank
(not once per chosen expert), the FP4 dispatch's rows are the packed payload (H/2 + H/32 bytes:
3808 at H 7168, against 14336 for BF16 and 7392 for DeepEP's FP8), the gradient and the combine
stay BF16, and DeepEP's buffer is the BF16-sized one either way (megatron_fp4/estimator/a2a.py,
device.py; docs/estimator.md)."""

import itertools
import json
import warnings
from math import comb
from pathlib import Path

import pytest

from megatron_fp4.cli import main as cli_main
from megatron_fp4.estimator import estimate
from megatron_fp4.estimator.a2a import deepep_ranks_per_token, row_bytes
from megatron_fp4.estimator.device import deepep_num_sms, uses_deepep

ROOT = Path(__file__).resolve().parents[2]
FAMILY = ROOT / "configs" / "deepseek_v3_671b" / "fp8_flow_moe_ae"  # flex on DeepEP, no group-limited routing
DSV3 = ROOT / "configs" / "deepseek_v3_671b"  # alltoall, group-limited routing (8 groups, 4 chosen)
# The FP4 recipe of the family on the flex dispatcher instead of alltoall (fp4.yaml switches it off).
FLEX = {"moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "deepep"}


def _estimate(path, mode="recipe", overrides=None, precision=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return estimate(path, mode, overrides, precision)


def _enumerated_ranks(experts, topk, ep, groups=None, group_topk=None):
    """The mean over every routing the assumption allows, counted one by one."""
    local = experts // ep
    per_group = experts // groups if groups else experts
    choices = itertools.combinations(range(groups), group_topk) if groups else [(0,)]
    total = count = 0
    for chosen in choices:
        pool = [g * per_group + i for g in chosen for i in range(per_group)]
        for picked in itertools.combinations(pool, topk):
            total += len({e // local for e in picked})
            count += 1
    return total / count


@pytest.mark.parametrize("experts, topk, ep, groups, group_topk", [
    (8, 2, 4, None, None), (8, 3, 2, None, None), (12, 4, 6, None, None), (16, 4, 4, 4, 2), (16, 3, 8, 4, 2)])
def test_distinct_ranks_per_token_is_the_expectation_under_uniform_routing(experts, topk, ep, groups, group_topk):
    assert deepep_ranks_per_token(experts, topk, ep, groups, group_topk) == pytest.approx(
        _enumerated_ranks(experts, topk, ep, groups, group_topk))


def test_distinct_ranks_per_token_bounds_and_dsv3_figures():
    assert deepep_ranks_per_token(256, 8, 256) == pytest.approx(8)  # one expert per rank: k ranks
    assert deepep_ranks_per_token(256, 8, 1) == 1  # one rank
    assert deepep_ranks_per_token(0, 0, 8) == 0
    for ep in (8, 16, 32):  # between 1 and min(k, EP); below the with-replacement approximation
        d = deepep_ranks_per_token(256, 8, ep)
        assert 1 < d < min(8, ep)
        assert d == pytest.approx(ep * (1 - comb(256 - 256 // ep, 8) / comb(256, 8)))
        assert d <= ep * (1 - (1 - 1 / ep) ** 8) + 0.1
    # DeepSeek-V3 (256 experts, top-8): EP 32 uniform 7.27 ranks; with 4 of 8 groups chosen 6.60.
    assert deepep_ranks_per_token(256, 8, 32) == pytest.approx(7.2668, abs=1e-4)
    assert deepep_ranks_per_token(256, 8, 32, 8, 4) == pytest.approx(6.5965, abs=1e-4)
    assert deepep_ranks_per_token(256, 8, 8, 8, 4) == pytest.approx(3.6290, abs=1e-4)
    # A group smaller than a rank's experts is not modelled: every expert stays in the pool.
    assert deepep_ranks_per_token(256, 8, 8, 64, 4) == deepep_ranks_per_token(256, 8, 8)


def test_flex_fp4_dispatch_sends_the_packed_payload_once_per_destination_rank():
    fp4_alltoall = _estimate(FAMILY / "fp4_ep32_sel.yaml", "installed")
    fp4_flex = _estimate(FAMILY / "fp4_ep32_sel.yaml", "installed", FLEX)
    bf16_flex = _estimate(FAMILY / "bf16_ep32_sel.yaml")
    fp8_flex = _estimate(FAMILY / "te_blockwise_ep32_sel.yaml", precision={"fp8_dispatch": True})  # DeepEP's FP8
    ranks = deepep_ranks_per_token(256, 8, 32)
    # Bytes per token per destination rank at H 7168: 3808 packed MXFP4, 7392 FP8, 14336 BF16.
    assert row_bytes("fp4", 7168) == 3584 + 224 == 3808
    assert row_bytes("fp8", 7168) == 7168 + 4 * 7168 // 128 == 7392
    assert fp4_flex.a2a.dispatch_forward / bf16_flex.a2a.dispatch_forward == 3808 / 14336
    assert fp8_flex.a2a.dispatch_forward / bf16_flex.a2a.dispatch_forward == 7392 / 14336
    # The dispatch's gradient and the combine: BF16 on DeepEP's combine, like BF16 flex.
    for name in ("dispatch_backward", "combine_forward", "combine_backward"):
        assert getattr(fp4_flex.a2a, name) == getattr(bf16_flex.a2a, name), name
    # Against the alltoall dispatcher of the same config: k = 8 rows per token there, 7.27 here.
    assert fp4_flex.a2a.dispatch_forward / fp4_alltoall.a2a.dispatch_forward == pytest.approx(ranks / 8)
    assert fp4_flex.a2a.combine_forward / fp4_alltoall.a2a.combine_forward == pytest.approx(ranks / 8)
    # Absolute: 8 MoE layers on the busiest stage x 480 micro-batches (15360 / DP 32) x 4096 tokens x
    # ranks x 3808 bytes.
    assert fp4_flex.a2a.dispatch_forward == pytest.approx(8 * 480 * 4096 * ranks * 3808)
    assert fp4_flex.a2a.dispatch_forward / 1e9 == pytest.approx(435.2, abs=0.1)


def test_flex_counts_distinct_ranks_for_bf16_too_and_alltoall_is_unchanged():
    bf16_flex = _estimate(FAMILY / "bf16_ep32_sel.yaml")
    bf16_alltoall = _estimate(FAMILY / "bf16_ep32_sel.yaml", overrides={
        "moe_token_dispatcher_type": "alltoall", "moe_flex_dispatcher_backend": None})
    ratio = deepep_ranks_per_token(256, 8, 32) / 8
    assert bf16_flex.a2a.total / bf16_alltoall.a2a.total == pytest.approx(ratio)
    assert bf16_alltoall.a2a.dispatch_forward == pytest.approx(8 * 480 * 4096 * 8 * 14336)
    # A full-recompute variant sends the layer's forward again, the same rows.
    full = _estimate(FAMILY / "bf16_ep32_full.yaml").a2a
    assert full.recompute_forward == pytest.approx(full.dispatch_forward + full.combine_forward)


def test_group_limited_routing_reaches_fewer_ranks():
    """configs/deepseek_v3_671b routes to 4 of 8 groups: on flex its rows per token are 6.60 at EP 32."""
    overrides = {"moe_token_dispatcher_type": "flex", "moe_enable_deepep": True, "moe_shared_expert_overlap": False}
    alltoall = _estimate(DSV3 / "fp4_mla_up_proj.yaml", "installed").a2a
    flex = _estimate(DSV3 / "fp4_mla_up_proj.yaml", "installed", overrides).a2a
    assert flex.dispatch_forward / alltoall.dispatch_forward == pytest.approx(
        deepep_ranks_per_token(256, 8, 32, 8, 4) / 8)


def test_deepep_buffer_is_the_bf16_sized_one_with_the_fp4_dispatch():
    """dispatch/deepep.py sizes Megatron's one DeepEP buffer for the BF16 combine (hidden bytes 2H),
    as the BF16 dispatch does: the device row does not change with --moe-fp4-dispatch."""
    fp4_flex = _estimate(FAMILY / "fp4_ep32_sel.yaml", "installed", FLEX)
    bf16_flex = _estimate(FAMILY / "bf16_ep32_sel.yaml")
    assert fp4_flex.device.deepep == bf16_flex.device.deepep > 0
    assert _estimate(FAMILY / "fp4_ep32_sel.yaml", "installed").device.deepep == 0  # alltoall


def test_deepep_backend_and_sms_read_as_megatron_resolves_them():
    from types import SimpleNamespace

    flex = dict(moe_token_dispatcher_type="flex")
    assert uses_deepep(SimpleNamespace(**flex, moe_flex_dispatcher_backend="deepep"))
    assert uses_deepep(SimpleNamespace(**flex, moe_enable_deepep=True, moe_flex_dispatcher_backend="ncclep"))
    assert not uses_deepep(SimpleNamespace(**flex, moe_flex_dispatcher_backend="hybridep"))
    assert not uses_deepep(SimpleNamespace(moe_token_dispatcher_type="alltoall", moe_enable_deepep=True))
    assert deepep_num_sms(SimpleNamespace()) == 20
    assert deepep_num_sms(SimpleNamespace(moe_deepep_num_sms=24)) == 24
    assert deepep_num_sms(SimpleNamespace(moe_flex_dispatcher_num_sms=32, moe_deepep_num_sms=24)) == 32


def test_estimate_cli_accepts_and_counts_a_flex_fp4_config(capsys):
    sets = [f"--set={k}={v}" for k, v in FLEX.items()]
    assert cli_main(["estimate", str(FAMILY / "fp4_ep32_sel.yaml"), "--json", "--fp4-memory", "installed", *sets]) == 0
    rows = json.loads(capsys.readouterr().out)
    row = rows[0] if isinstance(rows, list) else rows
    assert row["a2a_gb_per_step"]["dispatch_forward"] == pytest.approx(435.2, abs=0.1)
    # Refused the same as a launch: DeepEP's combine carries the gradient back in BF16 only.
    assert cli_main(["estimate", str(FAMILY / "fp4_ep32_sel.yaml"), *sets, "--set=moe_fp4_dispatch_grad=fp8"]) == 2
    assert "--moe-fp4-dispatch-grad fp8 is not served through the flex dispatcher" in capsys.readouterr().err
