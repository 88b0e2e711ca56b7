"""megatron_fp4's permute (dispatch/permute.py: Megatron's gathers, the sums without atomics, no
identity chunk sort on one rank) against Megatron's own, through Megatron's all-to-all dispatcher on
one rank, dropless and with drop-and-pad: the same routing, gathers and probs gradient; the unpermute
and the permute's gradient equal to the reference sums and within BF16 rounding of Megatron's
atomics; dropped tokens get no gradient (tests/support/lean_permute_checks.py, in a process of its
own: the dispatcher needs torch.cuda, emulated without a GPU)."""

import os
import subprocess
import sys
from pathlib import Path

from types import SimpleNamespace

from megatron_fp4.dispatch.permute import LeanPermute

ROOT = Path(__file__).resolve().parents[2]


def test_lean_permute_against_megatrons():
    # Kept: a PYTHONPATH that brings megatron-core (the GPU machines install it outside the venv).
    path = [str(ROOT / "tests"), str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    run = subprocess.run([sys.executable, "-m", "support.lean_permute_checks"], cwd=ROOT / "tests", env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "dropless: ok" in run.stdout and "dropped and padded: ok" in run.stdout


def test_fused_permute_keeps_transformer_engines_sums():
    class Stub(LeanPermute):  # TransformerConfig refuses the fusion without Transformer Engine
        def __init__(self, fused):
            self.config = SimpleNamespace(moe_permute_fusion=fused)

    assert Stub(False)._atomic_free_sums() and not Stub(True)._atomic_free_sums()
