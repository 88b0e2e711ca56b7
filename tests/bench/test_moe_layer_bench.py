"""The MoE layer benchmark on the CPU: its torch._grouped_mm experts (the peer of our FP8 experts)
against Megatron's SequentialMLP, the host-time arithmetic, and one run of the benchmark itself at
EP 1 on tiny shapes under the CUDA emulation (tests/support/layer_bench_on_cpu.py), every layer
variant through the code the GPU runs, rows checked against the schema."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

from support.one_rank import one_rank_parallel_state

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # benchmarks/ is a folder of the repository, not of the installed package

from benchmarks import bench_moe_layer as bench  # noqa: E402
from benchmarks import rows  # noqa: E402
from benchmarks.grouped_mm_experts import GroupedMMExperts  # noqa: E402

HIDDEN, FFN = 64, 32
COUNTS = [5, 0, 10, 1]  # an empty expert, a single token


@pytest.fixture
def one_rank():
    with one_rank_parallel_state() as pg_collection:
        yield pg_collection


def _sequential_mlp(pg_collection, **overrides):
    settings = dict(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, num_moe_experts=len(COUNTS), moe_router_topk=2,
        moe_ffn_hidden_size=FFN, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        use_cpu_initialization=True, bf16=True, params_dtype=torch.bfloat16, gradient_accumulation_fusion=False,
    )
    config = TransformerConfig(**dict(settings, **overrides))
    builder = get_gpt_layer_local_spec(num_experts=len(COUNTS)).submodules.mlp.keywords["submodules"].experts
    torch.manual_seed(3)
    return builder(len(COUNTS), config, pg_collection=pg_collection)


def _step(experts, tokens, probs, grad):
    x, p = tokens.clone().requires_grad_(True), probs.clone().requires_grad_(True)
    out, bias = experts(x, torch.tensor(COUNTS), p)
    assert bias is None
    out.backward(grad)
    return out, x.grad, p.grad


@pytest.mark.parametrize("offset", [0.0, 0.5], ids=["swiglu", "glu-offset"])
def test_grouped_mm_experts_compute_what_sequential_mlp_does(one_rank, offset):
    stock = _sequential_mlp(one_rank, glu_linear_offset=offset)
    peer = GroupedMMExperts.from_sequential_mlp(stock)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randn(sum(COUNTS), HIDDEN, generator=g).bfloat16()
    probs = torch.rand(sum(COUNTS), generator=g)
    grad = torch.randn(sum(COUNTS), HIDDEN, generator=g).bfloat16()
    expected, got = _step(stock, tokens, probs, grad), _step(peer, tokens, probs, grad)
    for name, a, e in zip(("output", "input grad", "probs grad"), got, expected):
        torch.testing.assert_close(a, e, msg=name)
    for e, expert in enumerate(stock.local_experts):
        torch.testing.assert_close(peer.fc1.grad[e], expert.linear_fc1.weight.grad, msg=f"fc1 grad {e}")
        torch.testing.assert_close(peer.fc2.grad[e], expert.linear_fc2.weight.grad, msg=f"fc2 grad {e}")
    assert not peer.fc1.grad[1].any() and not peer.fc2.grad[1].any()  # the expert without tokens


def test_grouped_mm_experts_refuse_what_they_do_not_compute(one_rank):
    with pytest.raises(ValueError, match="without bias only: add_bias_linear"):
        GroupedMMExperts.from_sequential_mlp(_sequential_mlp(one_rank, add_bias_linear=True))
    with pytest.raises(ValueError, match="multiples of 8"):
        GroupedMMExperts(torch.zeros(2, 8, 12), torch.zeros(2, 12, 4))


CASES = (bench.STOCK, bench.GROUPED_MM, bench.FP8_BASELINE, bench.FP4_BF16, bench.FP4_FP8,
         bench.FP8_BASELINE_PER_EXPERT, bench.FP4_FP8_PER_EXPERT, bench.FP4_FP8_WEIGHTS_PER_USE,
         bench.FP4_FP8_KEEP_TRANSPOSED, bench.FP4_FP8_TRITON, bench.FP8_BASELINE_LEAN_PERMUTE)
EVERY_CASE = {"layer forward+backward", "host time (wall - GPU busy)", "saved for backward",
              "experts GEMM rate over the layer time"}


def test_the_layer_benchmark_runs_every_variant_at_ep1_and_writes_rows(tmp_path):
    env = dict(os.environ, MEGATRON_FP4_BENCH_RESULTS=str(tmp_path), MEGATRON_FP4_COMMIT="abc1234",
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]))
    shape = ["--hidden", "128", "--ffn", "128", "--experts", "2", "--topk", "2", "--tokens", "16",
             "--iters", "1", "--warmup", "0", "--gemm-variants"]
    run = subprocess.run([sys.executable, "-m", "support.layer_bench_on_cpu", *shape], cwd=ROOT / "tests", env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "EP 1: no all-to-all" in run.stdout
    written = [json.loads(line) for line in (tmp_path / "bench_moe_layer.jsonl").read_text().splitlines()]
    for row in written:
        assert rows.row_problems(row) == [], row
        assert (row["bench"], row["gpus"], row["commit"], row["hidden"], row["tokens_per_gpu"]) == (
            "bench_moe_layer", 1, "abc1234", 128, 16)
    metrics = {case: {(r["metric"], r["reference"]) for r in written if r["case"] == case} for case in CASES}
    for case in CASES:
        assert EVERY_CASE <= {metric for metric, _ in metrics[case]}, case
        assert ("layer forward+backward", bench.STOCK) in metrics[case]
        assert ("host time (wall - GPU busy)", bench.HOST_WALL) in metrics[case]
        assert ("experts GEMM rate over the layer time", bench.GROUPED_MM) in metrics[case]
    for case in (bench.FP8_BASELINE, bench.FP4_FP8):
        assert ("layer forward+backward", bench.GROUPED_MM) in metrics[case]
    assert ("layer forward+backward", bench.FP8_BASELINE) in metrics[bench.FP4_FP8]
    assert ("layer forward+backward", bench.FP8_BASELINE_LEAN_PERMUTE) in metrics[bench.FP4_FP8]
    # No CUDA allocator here: the allocator's rows are the GPU run's.
    assert not any(r["metric"] in ("held for backward", "step peak above allocated before") for r in written)

    saved = {r["case"]: r["value"] for r in written if r["metric"] == "saved for backward"
             and r["reference"] == bench.STOCK}
    # FP4 + FP8 saves the MXFP4 payload and MXFP4 activations where the FP8 baseline keeps BF16.
    assert 0 < saved[bench.FP4_FP8] < saved[bench.FP8_BASELINE]
    # The peer agreed with the stock layer (the run stops otherwise) and says so.
    peer_line = next(line for line in run.stdout.splitlines() if line.strip().startswith(bench.GROUPED_MM + ":"))
    assert all(float(e) <= bench.GROUPED_MM_AGREES for e in peer_line.split(":")[1].split(","))
