"""--moe-fp4-telemetry through Megatron's own training loop: our launcher trains a tiny MoE GPT on
two CPU processes (torch.cuda emulated, gloo, EP 2; tests/support/telemetry_training.py), FP4
dispatch + FP8 experts + the recompute cache under `moe` recompute. The numbers reach Megatron's
iteration log line, TensorBoard and W&B (stand-in writers) at every logged iteration, the bytes
and cache hits are those of the formula, and telemetry reads nothing from the device inside the
forward and backward passes."""

import json
import os
import socket
import sys
from pathlib import Path

import pytest
import torch

from megatron_fp4.formats import mxfp4_wire_bytes_per_row

from support import telemetry_training as run
from support.rank_processes import run_ranks

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "support" / "telemetry_training.py"
WORLD = 2
TIMEOUT_S = 600  # about 50 s on two busy cores
FLAGS = ["--moe-fp4-dispatch", "--moe-fp4-experts", "fp8", "--moe-fp4-cache", "--recompute-granularity",
         "selective", "--recompute-modules", "moe", "--moe-fp4-telemetry"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(tmp_path, flags):
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    port = _free_port()
    commands = [[sys.executable, str(SCRIPT), str(r), str(WORLD), str(port), str(tmp_path / f"{r}.json"), *flags]
                for r in range(WORLD)]
    codes, outputs = run_ranks(commands, ROOT, env, TIMEOUT_S)
    assert codes == [0] * WORLD, "\n".join(f"--- rank {r} (exit {c}):\n{o[-3000:]}" for r, (c, o) in
                                           enumerate(zip(codes, outputs)))
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU emulation of a training run")
def test_numbers_reach_megatrons_log_tensorboard_and_wandb(tmp_path):
    results = _train(tmp_path, FLAGS)
    last = results[-1]  # Megatron prints the iteration line on the last rank
    assert len(last["log_lines"]) == run.ITERATIONS
    for line in last["log_lines"]:
        assert "| lm loss: " in line and " | fp4 dispatch fwd MB: " in line, line
        for field in ("fp4 dispatch bwd MB", "fp4 rel rms error", "fp4 cache hits: 2.0", "fp4 held peak MiB"):
            assert f" {field}" in line, line

    # Per step and GPU: 2 micro-batches of 2 x 16 tokens, each sent to both experts (one per rank, so
    # each rank receives as many rows as it sends). The first pass sends MXFP4 rows; the recompute is
    # served by the cache (a hit), where BF16 would send again; the gradient rows go back in BF16.
    per_micro_batch = run.MICRO_BATCH * run.SEQ * run.TOPK
    rows = 2 * per_micro_batch
    bf16_row = 2 * run.HIDDEN
    expected = {"fp4/dispatch-forward-bytes": rows * mxfp4_wire_bytes_per_row(run.HIDDEN),
                "fp4/dispatch-forward-bytes-bf16": 2 * rows * bf16_row,
                "fp4/dispatch-backward-bytes": rows * bf16_row, "fp4/dispatch-backward-bytes-bf16": rows * bf16_row,
                "fp4/cache-hits": 2.0}
    # Held at once (Megatron runs each micro-batch's backward right after its forward without
    # pipelining): one micro-batch's cached payload, then, its entry taken by the recompute, the same
    # payload kept by its FP8 experts. Inside the recompute they keep nothing else in MXFP4 (the SwiGLU
    # input in BF16, the fc2 input as FP8 columns: nothing inexact in FP4 there).
    expected["fp4/held-peak-bytes"] = per_micro_batch * mxfp4_wire_bytes_per_row(run.HIDDEN)
    for result in results:  # every rank reads the reduced numbers (the stand-in writers exist on each)
        scalars = result["scalars"]
        for writer in ("tensorboard", "wandb"):
            written = {(name, step): value for name, value, step in scalars[writer] if name.startswith("fp4/")}
            for step in range(1, run.ITERATIONS + 1):
                for name, value in expected.items():
                    assert written[(name, step)] == value, (writer, name, step)
                assert 0.05 < written[("fp4/dispatch-relative-rms-error", step)] < 0.2, (writer, step)

        steps = result["host_reads_per_step"]
        assert len(steps) == run.ITERATIONS and all(steps), "no host read counted: the counting is broken"
        from_telemetry = [name for reads in steps for name, by_telemetry in reads if by_telemetry]
        assert not from_telemetry, f"rank {result['rank']}: telemetry read {from_telemetry} from the device"
