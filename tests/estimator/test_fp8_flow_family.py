"""The FP8-Flow-MoE artifact's DeepSeek-V3 671B configurations (configs/deepseek_v3_671b/fp8_flow_moe_ae/)
in the estimator: the fork's `moe_expert` and `attn` recompute, the device-level rows, the measured
table (benchmarks/estimator_671b.py) and the paper's scope 1 on that family (docs/estimator.md)."""

import functools
import warnings
from pathlib import Path

import pytest

from megatron_fp4.estimator import GIB, estimate
from megatron_fp4.estimator.device import (ALLOCATOR_RESERVE_FRACTION, CUDA_CONTEXT_BYTES, NCCL_CHANNELS,
                                           NCCL_RING_BYTES_PER_CHANNEL, P2P_BYTES_PER_PEER)
from megatron_fp4.estimator.precision import FP8_1X128_BYTES, MXFP4_BYTES
from megatron_fp4.estimator.wgrad_buffers import CUBLAS_WORKSPACE_BYTES
from megatron_fp4.run_config import load_config, parse_config_argv, validate_config

ROOT = Path(__file__).resolve().parents[2]
FAMILY = ROOT / "configs" / "deepseek_v3_671b" / "fp8_flow_moe_ae"
LAYOUTS = {8: 32, 16: 16, 32: 8}  # EP -> PP
MIB = 2**20


@functools.lru_cache(maxsize=None)
def family(name: str, fp8_dispatch: bool = False):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return estimate(FAMILY / f"{name}.yaml", precision={"fp8_dispatch": True} if fp8_dispatch else None)


def test_family_configs_mirror_the_artifact_and_dry_run():
    names = sorted(p.stem for p in FAMILY.glob("*_*_*.yaml"))
    assert names == sorted(f"{p}_ep{ep}_{s}" for p in ("bf16", "fp4", "te_blockwise") for ep in LAYOUTS
                           for s in ("full", "sel"))
    for name in names:
        config = load_config(FAMILY / f"{name}.yaml")
        args = parse_config_argv(config)
        ep = args.expert_model_parallel_size
        assert config.world_size() == 256 and args.pipeline_model_parallel_size == LAYOUTS[ep]
        assert (args.tensor_model_parallel_size, args.micro_batch_size, args.global_batch_size) == (1, 1, 15360)
        assert args.mtp_num_layers is None and args.main_grads_dtype == "bf16" and args.optimizer_cpu_offload
        fp4 = name.startswith("fp4")
        assert args.moe_token_dispatcher_type == ("alltoall" if fp4 else "flex")
        assert (args.fp8_recipe == "blockwise" and args.fp8 == "e4m3") is name.startswith("te_blockwise")
        if name.endswith("sel"):
            assert args.recompute_modules == ["attn", "layernorm", "moe_expert"]
        else:
            assert (args.recompute_granularity, args.recompute_method, args.recompute_num_layers) == (
                "full", "uniform", 1)
        validate_config(config)  # what a dry run checks (Megatron 0.19 itself refuses the fork's modules)


def test_layouts_hold_what_1f1b_holds():
    for ep, pp in LAYOUTS.items():
        e = family(f"bf16_ep{ep}_full")
        assert (e.parallel.ep, e.parallel.pp, e.parallel.vpp, e.parallel.dp, e.parallel.edp) == (ep, pp, 1, 256 // pp, 1)
        for r in e.ranks:
            assert r.held == [pp - r.rank]  # 1F1B: PP - rank micro-batches in flight
    stages = family("bf16_ep8_full").parallel.chunks
    assert [kind for kind, _ in stages[0][0]] == ["embedding"]
    assert [kind for kind, _ in stages[31][0]] == ["moe", "loss"]


def test_moe_expert_keeps_the_dispatched_input_and_the_layer_around_the_experts():
    s = family("te_blockwise_ep8_sel").shape
    rows, h = s.seq_length * s.topk, s.hidden
    for name, fp8_dispatch, per_element in (("bf16_ep8_sel", False, 2), ("te_blockwise_ep8_sel", False, 2),
                                            ("te_blockwise_ep8_sel", True, FP8_1X128_BYTES),
                                            ("fp4_ep8_sel", False, MXFP4_BYTES)):
        e = family(name, fp8_dispatch)
        c = e.ranks[3].components  # two MoE layers
        assert c["moe.expert_checkpoint_in"] == 2 * rows * h * per_element, name
        assert c["moe.expert_probs"] == 2 * rows * 4
        assert not {"moe.expert_fc1_in", "moe.expert_fc1_out", "moe.expert_fc2_in"} & set(c)
        assert {"moe.router", "moe.routing_indices", "moe.shared_fc1_out", "moe.shared_fc2_in"} <= set(c)
        assert e.a2a.recompute_forward == 0  # nothing of the layer's communication runs again
    full = family("bf16_ep8_full")
    assert full.a2a.recompute_forward > 0


def test_attn_keeps_only_the_layer_input():
    c = family("bf16_ep8_sel").ranks[3].components
    assert {k for k in c if k.startswith("moe.") and not k.startswith(("moe.expert", "moe.router", "moe.routing",
                                                                       "moe.shared"))} == {
        "moe.layer_input", "moe.mlp_input"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kept = estimate(FAMILY / "bf16_ep8_sel.yaml", overrides={"recompute_modules": ["attn", "moe_expert"]})
    s = kept.shape
    assert kept.ranks[3].components["moe.attn_checkpoint_in"] == 2 * s.seq_length * s.hidden * 2


def test_device_rows_are_the_stated_quantities():
    # DeepEP (Megatron's get_buffer, DeepEP's default configs, 20 SMs, BF16 rows of 7168).
    per_token = 7168 * 2 + 8 + 128 * 8 + 128 * 4 + 128 * 4
    workspace = 32 * MIB
    ep8 = 10 * 8 * (256 * per_token + 5 * 4) + workspace
    ep16_nvl = 10 * 8 * (288 * per_token + 7 * 4) + workspace
    assert family("bf16_ep8_full").device.deepep == ep8
    assert family("bf16_ep16_full").device.deepep == ep16_nvl + 2**29  # RDMA buffer: one 512 MiB heap step
    assert family("te_blockwise_ep32_sel").device.deepep == 10 * 8 * (288 * per_token + 11 * 4) + workspace + 2**29
    assert family("fp4_ep8_sel").device.deepep == 0  # the alltoall dispatcher
    ring = NCCL_CHANNELS * NCCL_RING_BYTES_PER_CHANNEL
    assert ring == pytest.approx(294 * MIB)
    # world, data parallel, model parallel, pipeline, expert parallel; two pipeline neighbours
    assert family("bf16_ep8_full").device.nccl == 5 * ring + 2 * P2P_BYTES_PER_PEER
    assert family("fp4_ep8_sel").device.nccl == 5 * ring + (2 + 7) * P2P_BYTES_PER_PEER  # + alltoall peers
    for name in ("bf16_ep8_full", "te_blockwise_ep32_sel"):
        e = family(name)
        assert e.device.cuda_context == CUDA_CONTEXT_BYTES
        assert e.device.allocator_reserve == pytest.approx(ALLOCATOR_RESERVE_FRACTION * e.peak_rank.peak)
        assert e.device_peak_gib == pytest.approx((e.peak_rank.peak + e.device.total) / GIB)
        assert e.fraction == pytest.approx(e.device_peak_gib / 80)


def test_verdict_tight_is_a_fit_only_without_the_reserve():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = estimate(ROOT / "configs" / "deepseek_v3_671b" / "fp4_mla_up_proj.yaml", overrides={
            "main_grads_dtype": "fp32", "pipeline_model_parallel_layout": "Et*2|(tt|)*22t|(tt|)*7mL"})
    assert (e.peak_rank.peak + e.device.outside_allocator) / GIB <= 80 < e.device_peak_gib
    assert e.verdict == "tight" and e.fits


@pytest.fixture(scope="module")
def artifact():
    from benchmarks import estimator_671b

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return estimator_671b.validation_rows(estimator_671b._info())


def test_measured_table_rows_and_the_gap_they_document(artifact):
    """docs/estimator.md: every measured peak is 5 to 15 GiB above the estimate (a term of about 7
    GiB no row holds); the two OOM cells are estimated under 80 GiB."""
    from benchmarks.rows import row_problems

    assert len(artifact) == 18
    for row in artifact:
        assert row_problems(row) == [], row["case"]
        if row["outcome"] == "OOM":
            assert row["value"] < 80 and row["precision"] in ("bf16", "te_blockwise") and row["ep"] == 32
            continue
        gap = row["value"] - row["reference_value"]
        assert 5 < gap < 15, row["case"]


@pytest.mark.xfail(strict=True, reason="a near-constant ~7 GiB per GPU of the measured peaks is in no row of the "
                                       "estimate: docs/estimator.md, 'The FP8-Flow-MoE configurations'")
def test_bf16_and_te_blockwise_cells_within_10_percent(artifact):
    for row in artifact:
        if row["precision"] == "fp8flow":
            continue
        if row["outcome"] == "OOM":
            assert row["ratio"] > 1, row["case"]
        else:
            assert abs(row["ratio"] - 1) <= 0.10, row["case"]


def test_paper_scope_1_is_the_allocated_peak_at_ep16_pp16():
    """The FP4 paper's BF16 68.29% / FP8 74.20% at `attn layernorm moe_expert`: the allocated peak
    (% of 80 GiB) at EP 16 / PP 16 within 3 points, EP 8 and 32 not; the device-level peak nowhere;
    our FP4 recipe below FP8 there."""
    def percent(name, device=False):
        e = family(name)
        return 100 * (e.device_peak_gib if device else e.peak_gib) / 80

    bf16, fp8, fp4 = (percent(f"{p}_ep16_sel") for p in ("bf16", "te_blockwise", "fp4"))
    assert abs(bf16 - 68.29) <= 3 and abs(fp8 - 74.20) <= 3
    assert fp8 - fp4 > 14.80  # the paper's FP4 saving there is 14.80 points; ours larger (docs)
    for ep in (8, 32):
        assert abs(percent(f"bf16_ep{ep}_sel") - 68.29) > 3 and abs(percent(f"te_blockwise_ep{ep}_sel") - 74.20) > 3
    for ep in LAYOUTS:
        assert percent(f"bf16_ep{ep}_sel", True) - 68.29 > 3 and percent(f"te_blockwise_ep{ep}_sel", True) - 74.20 > 3


def test_fastest_scope_fits_under_75_gib_with_the_device_rows():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = estimate(ROOT / "configs" / "deepseek_v3_671b" / "fp4_mla_up_proj.yaml")
    assert e.recompute.modules == {"mla_up_proj"} and e.precision.fp4_storage_all
    assert e.device_peak_gib <= 75 and e.verdict == "fits"
    flags = load_config(e.config).flags  # BF16 main gradients, handed to DDP (docs: "The fastest scope's margin")
    assert flags["main_grads_dtype"] == "bf16" and flags["no_gradient_accumulation_fusion"] is True


def test_our_recompute_experts_flag_is_estimated_as_moe_expert():
    """--moe-fp4-recompute-experts on stock Megatron is the fork's `moe_expert`: the one-GPU proxies'
    experts-only configs hold each precision's dispatched rows and nothing else of the experts."""
    proxy = ROOT / "configs" / "proxy"
    for precision, per_element in (("bf16", 2), ("fp8", 2), ("fp4", MXFP4_BYTES)):
        e = estimate(proxy / f"memcap1_{precision}_attn_ln_experts.yaml", "installed")
        assert e.recompute.label() == "core_attn,layernorm,mlp,moe_expert", precision
        c, s = e.peak_rank.components, e.shape
        assert c["moe.expert_checkpoint_in"] == 5 * s.micro_batch * s.seq_length * s.topk * s.hidden * per_element
        assert not {"moe.expert_fc1_in", "moe.expert_fc1_out", "moe.expert_fc2_in"} & set(c), precision


def test_weight_gradient_buffers_are_the_stated_quantities():
    """estimator/wgrad_buffers.py on the family (TP 1, 256 experts, BF16, gradient-accumulation fusion):
    on Transformer Engine's layers the cuBLAS workspaces (four more where its grouped experts run), one
    cached dummy weight gradient per distinct linear shape (the output layer's on the last rank), and
    the grouped experts' fc1 dummies in the MoE backward's working set; on our FP8 layers their own
    cached dummies and no workspace: one per shape, so the routed experts add none of their own
    (DeepSeek-V3's shared expert has their two shapes)."""
    mla = [(1536, 7168), (576, 7168), (7168, 128 * 128), (128 * 192, 1536), (128 * 256, 512)]
    shared, dense = [(2 * 2048, 7168), (7168, 2048)], [(2 * 18432, 7168), (7168, 18432)]
    moe_stage, dense_stage = (sum(n * k for n, k in mla + mlp) * 2 for mlp in (shared, dense))
    both = sum(n * k for n, k in mla + shared + dense) * 2
    e = family("bf16_ep8_full")
    ranks = {r.rank: r for r in e.ranks}
    assert [[kind for kind, _ in chunk] for r in (0, 1, 2, 3) for chunk in e.parallel.chunks[r]] == [
        ["embedding"], ["dense", "dense"], ["dense", "moe"], ["moe", "moe"]]
    one, grouped = CUBLAS_WORKSPACE_BYTES, 5 * CUBLAS_WORKSPACE_BYTES  # + one per stream of the grouped GEMMs
    assert ranks[0].static.wgrad_buffers == 0  # the embedding alone: no linear
    assert ranks[1].static.wgrad_buffers == one + dense_stage
    assert ranks[2].static.wgrad_buffers == grouped + both  # MLA's shapes once: one dummy per shape
    assert ranks[3].static.wgrad_buffers == grouped + moe_stage
    assert ranks[31].static.wgrad_buffers == grouped + moe_stage + 129280 * 7168 * 2  # + the output layer
    fc1_dummies = {ep: 256 // ep * 2 * 2048 * 7168 * 2 for ep in LAYOUTS}
    assert fc1_dummies[8] / GIB == pytest.approx(1.75)
    for ep in LAYOUTS:
        fused = family(f"bf16_ep{ep}_sel")
        unfused = estimate(FAMILY / f"bf16_ep{ep}_sel.yaml", overrides={"no_gradient_accumulation_fusion": True})
        for a, b in zip(fused.ranks, unfused.ranks):
            assert b.static.wgrad_buffers in (0, one, grouped)  # the workspaces alone
        r = fused.peak_rank.rank
        assert "moe" in [kind for chunk in fused.parallel.chunks[r] for kind, _ in chunk]
        assert fused.ranks[r].transient - unfused.ranks[r].transient == pytest.approx(fc1_dummies[ep])
    fp4 = family("fp4_ep8_sel")  # local layers: our FP8 linears and experts
    ranks = {r.rank: r for r in fp4.ranks}
    assert ranks[0].static.wgrad_buffers == 0 and ranks[3].static.wgrad_buffers == moe_stage
    assert fp4.ranks[3].transient == estimate(FAMILY / "fp4_ep8_sel.yaml", overrides={
        "no_gradient_accumulation_fusion": True}).ranks[3].transient  # no grouped-expert dummies of ours


def test_dummy_shapes_split_as_the_layers_do_and_include_mtp():
    """At TP 2 every linear's dummy halves except MLA's q / kv down-projections (not split over TP);
    an MTP layer adds its eh_proj [H, 2H] (split) on Transformer Engine's layers; a shape shared by
    two weights (the routed and the shared experts') is one dummy."""
    import dataclasses

    from megatron_fp4.estimator import wgrad_buffers as wb
    from megatron_fp4.estimator.shapes import MOE, MTP

    def elements(shapes):
        return sum(rows * cols for rows, cols in shapes)

    e = family("bf16_ep8_full")
    s, p = e.shape, e.precision
    tp1, tp2 = e.parallel, dataclasses.replace(e.parallel, tp=2)
    one, two = wb.dummy_shapes(s, tp1, p, {MOE}), wb.dummy_shapes(s, tp2, p, {MOE})
    assert len(one) == len(two) == 7  # MLA's five, the shared expert's two
    assert (1536, 7168) in two and (576, 7168) in two and (7168, 128 * 128 // 2) in two and (2048, 7168) in two
    down = 1536 * 7168 + 576 * 7168  # q and kv down-projections
    assert elements(two) == (elements(one) - down) / 2 + down
    mtp = wb.dummy_shapes(dataclasses.replace(s, mtp_layers=1), tp2, p, {MOE, MTP})
    assert mtp - two == {(7168 // 2, 2 * 7168)}
    per_expert = wb.dummy_shapes(dataclasses.replace(s, grouped_gemm=False), tp1, p, {MOE})
    assert per_expert == one  # TE's per-expert linears: fc1 [4096, 7168] and fc2 [7168, 2048], as the shared
