"""The three lines of megatron_fp4.launch's docstring, added to a copy of a Megatron-LM-style
pretrain_gpt.py (tests/data/megatron_lm_pretrain_gpt.py), on CPU: they are all that changes; our
flags parse; a refused configuration stops with one sentence and exit status 2; the model provider
hands GPTModel a spec with FP4MoELayer and FP8Experts, in the decoder and the MTP layer."""

import difflib
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from megatron.training.global_vars import unset_global_variables

import megatron_fp4.launch as fp4
from megatron_fp4.experts import FP8Experts
from megatron_fp4.integration import FP4MoELayer
from megatron_fp4.run_config import load_config

ROOT = Path(__file__).resolve().parents[2]
STAND_IN = ROOT / "tests" / "data" / "megatron_lm_pretrain_gpt.py"
PROXY_ONE_GPU = ROOT / "configs" / "proxy" / "gpus1.yaml"
SMALL_MOE = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "64",
             "--max-position-embeddings", "64", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-4",
             "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--num-experts", "4"]


def documented_lines() -> list:
    """The code lines of the docstring's "three lines" block, without their comments."""
    doc = fp4.__doc__.splitlines()
    start = next(i for i, line in enumerate(doc) if "needs three lines" in line) + 2
    block = doc[start:doc.index("", start)]
    return [line.split("  #")[0].strip() for line in block]


def with_three_lines(text: str) -> str:
    """`text` (a pretrain_gpt.py) with the documented lines: the import after Megatron's imports,
    our parse_and_validate_args for Megatron's, the spec swap before the MTP spec is built."""
    imported, parse, swap = documented_lines()
    assert parse == "args = fp4.parse_and_validate_args(...)"

    def once(anchor):
        assert text.count(anchor) == 1, anchor
        return anchor

    last_import = once("from megatron.training.arguments import core_transformer_config_from_args, "
                       "parse_and_validate_args\n")
    text = text.replace(last_import, last_import + imported + "\n")
    text = text.replace(once("    args = parse_and_validate_args("), "    args = fp4.parse_and_validate_args(")
    mtp = once("    mtp_block_spec = None\n")
    return text.replace(mtp, f"    {swap}\n{mtp}")


@pytest.fixture
def user_script(tmp_path):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text(with_three_lines(STAND_IN.read_text()))
    return script


def _run(script, *argv):
    return subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, timeout=300,
                          check=False, cwd=ROOT,
                          # this checkout's package, also where another one is installed
                          env={"PATH": "/usr/bin:/bin", "WORLD_SIZE": "1", "RANK": "0", "PYTHONPATH": str(ROOT)})


def test_three_lines_are_all_that_changes(user_script):
    original = STAND_IN.read_text().splitlines()
    diff = [line for line in difflib.unified_diff(original, user_script.read_text().splitlines(), lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    added = [line for line in diff if line.startswith("+")]
    assert len(added) == 3, diff
    assert len(diff) - len(added) == 1  # the one changed line: Megatron's parse_and_validate_args


def test_user_script_parses_our_flags(user_script):
    result = _run(user_script, "--help")
    assert result.returncode == 0, result.stderr[-2000:]
    for flag in ("--moe-fp4-dispatch", "--moe-fp4-experts {bf16,fp8}", "--moe-fp4-cache", "--num-experts"):
        assert flag in result.stdout, flag


def test_user_script_refuses_with_one_sentence(user_script):
    result = _run(user_script, *SMALL_MOE, "--moe-fp4-cache")
    assert result.returncode == 2, result.stderr[-2000:]
    # The sentence is the last line, before Megatron's argument dump (stdout stays empty); the
    # notices before it are the user's script's imports, which the plugin leaves alone.
    assert result.stderr.splitlines()[-1] == ("error: --moe-fp4-cache needs --moe-fp4-dispatch: it caches the FP4 "
                                              "dispatch's payload.")
    assert result.stdout == "" and "Traceback" not in result.stderr


@pytest.fixture
def user_module(user_script, monkeypatch):
    """The copy imported as its training run would have it: Megatron's globals set by line 2."""
    monkeypatch.syspath_prepend(str(user_script.parent))
    monkeypatch.delitem(sys.modules, "pretrain_gpt", raising=False)
    module = importlib.import_module("pretrain_gpt")
    yield module
    sys.modules.pop("pretrain_gpt", None)
    unset_global_variables()


def test_user_model_provider_builds_fp4_layers_and_fp8_experts(user_module, one_rank, monkeypatch):
    argv = [*load_config(PROXY_ONE_GPU).argv(), "--moe-fp4-dispatch", "--moe-fp4-experts", "fp8",
            "--transformer-impl", "local", "--no-gradient-accumulation-fusion"]
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the validation's view of a GPU machine
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *device: (9, 0))  # Hopper
    unset_global_variables()
    fp4.parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})  # line 2, as the script
    built = {}
    monkeypatch.setattr(user_module, "GPTModel", lambda **kwargs: built.update(kwargs))  # MoE layers need CUDA
    user_module.model_provider()

    mlps = [layer.submodules.mlp for layer in built["transformer_layer_spec"].layer_specs]
    mlps.append(built["mtp_block_spec"].layer_specs[0].submodules.mtp_model_layer.submodules.mlp)
    moe = mlps[1:]
    assert len(moe) == 6  # 5 MoE decoder layers after the dense one, and the MTP layer
    assert getattr(mlps[0], "func", None) is not FP4MoELayer
    for layer in moe:
        assert layer.func is FP4MoELayer
        assert layer.keywords["submodules"].experts.func is FP8Experts
