"""The README's first commands, as a newcomer on a fresh clone runs them: the set-up and test
command is what CI (.ci/run) runs on its fresh clone, step for step; the main-job command takes the
machine's GPUs and refuses on a machine without GPUs in one line with exit status 2 (run here as
written); and the README stands alone (its links lead to files of the repository)."""

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from support.entry_points import one_error_line

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
CI = ROOT / ".ci" / "run"


def first_commands() -> list:
    """The commands of the README's first code block (continuation lines joined, comments dropped)."""
    block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    joined = block.replace("\\\n", " ")
    lines = [" ".join(line.split()) for line in joined.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def ci_lines() -> list:
    return [line.strip() for line in CI.read_text().splitlines()]


def test_the_set_up_and_test_command_is_what_ci_runs():
    set_up_and_tests, main_job = first_commands()
    steps = [step.strip() for step in set_up_and_tests.split("&&")]
    assert steps[0] == "PYENV_VERSION=3.12.1 python3.12 -m venv .venv"
    assert steps[-1] == ".venv/bin/python -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder tests"
    # CI runs each step as its own line, exactly as written, in the same order.
    lines = ci_lines()
    positions = [lines.index(step) for step in steps]
    assert positions == sorted(positions)
    assert main_job == "scripts/train_proxy.sh"  # the GPUs the machine has (tests/launch/test_launcher.py)


def test_the_set_up_python_runs_here_as_written():
    """The first step's interpreter, as the README spells it, starts on this machine and is 3.12
    (under pyenv a bare `python3.12` shim refuses to run without a selected version)."""
    set_up_and_tests, _ = first_commands()
    interpreter = set_up_and_tests.split("&&")[0].strip().removesuffix("-m venv .venv").strip()
    result = subprocess.run(f"{interpreter} -c 'import sys; print(sys.version_info[:2])'", shell=True, cwd="/",
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0 and result.stdout.strip() == "(3, 12)", result.stdout + result.stderr


def _gpus_here() -> int:
    if shutil.which("nvidia-smi") is None:
        return 0
    listed = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                            text=True, check=False, timeout=60)
    return len(listed.stdout.split()) if listed.returncode == 0 else 0


@pytest.mark.skipif(_gpus_here() > 0, reason="the main job runs on this machine's GPUs")
def test_the_main_job_refuses_without_gpus_in_one_line():
    _, main_job = first_commands()
    # As a newcomer's shell runs it: none of the script's knobs set.
    knobs = ("DRY_RUN", "NPROC", "PRECISION", "FP4", "PYTHON", "TORCHRUN", "RUN_NAME", "CUDA_VISIBLE_DEVICES")
    env = {key: value for key, value in os.environ.items() if key not in knobs}
    result = subprocess.run(shlex.split(main_job), cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 2 and result.stdout == ""
    sentence = one_error_line(result.stderr)
    assert "this machine's NVIDIA GPUs (1, 2, 4 or 8; Hopper: H100 or H200" in sentence and "finds none" in sentence


def test_the_readme_stands_alone():
    links = re.findall(r"\]\(([^)]+)\)", README)
    assert "docs/usage.md" in links
    for target in links:
        assert (ROOT / target).exists(), target  # a file of the repository, not a page elsewhere
    for path in re.findall(r"`((?:scripts|configs|docs|megatron_fp4|patches|benchmarks)/[^`\s<]*)`", README):
        assert (ROOT / path).exists(), path
    assert "DESIGN.md" not in README and not re.search(r"(?<![\w/])#\d+\b", README)  # no internal issue numbers
