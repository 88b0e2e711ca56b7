"""Version truth: each megatron-core release in megatron_versions.txt (one per release line the
start-up check accepts) runs forward + backward of the FP4 MoE layer with each feature, on CPU
(torch.cuda emulated, one gloo pair = EP 2), against that release's own wheel installed by .ci/run
into .megatron-versions/<version>/. One pytest item per (version, scenario), e.g.
`pytest tests/versions -k "0.18.2 and cache"`; one process pair per version runs the scenarios
selected for it, one after the other (start-up and imports once per version, not per scenario).
What each scenario checks: tests/versions/worker.py."""

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from support.rank_processes import run_ranks

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
VERSIONS_DIR = ROOT / ".megatron-versions"
VERSIONS = [line.strip() for line in (HERE / "megatron_versions.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]

# name: (worker check and its arguments, timeout in seconds). Every layer has a shared expert (no
# overlap unless named); features share an item where that costs one layer.
SCENARIOS = {
    "dispatch-bf16-ceil-saved-input": ({"check": "dispatch", "saved_input": True}, 180),
    "dispatch-fp8-floor-shared-overlap": (
        {"check": "dispatch", "dispatch_grad": "fp8", "scale_rule": "floor", "overlap": True}, 180),
    "cache": ({"check": "cache"}, 180),
    "fp8-experts": ({"check": "fp8_experts"}, 240),
}
WORLD = 2


def _version_folder(version: str) -> Path:
    folder = VERSIONS_DIR / version
    if not (folder / "megatron" / "core" / "package_info.py").is_file():
        why = (f"megatron-core {version} is not installed in {folder}: run .ci/run, or "
               f"`pip install --no-deps --target {folder} megatron-core=={version}`")
        if os.environ.get("CI") == "true":
            pytest.fail(why)  # CI installs it: a missing folder there is a broken install, not a skip
        pytest.skip(why)
    return folder


def _run_pair(folder: Path, version: str, scenarios: dict, timeout_s: int):
    """Both ranks as fresh processes running `scenarios` (name: the worker's check and arguments);
    (return codes, outputs). Killed after timeout_s."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)  # the worker puts the version folder first itself
    with tempfile.TemporaryDirectory() as tmp:
        commands = [[sys.executable, str(HERE / "worker.py"), str(r), str(WORLD), str(Path(tmp) / "init"), str(folder),
                     version, json.dumps(scenarios)] for r in range(WORLD)]
        return run_ranks(commands, ROOT, env, timeout_s)


@pytest.fixture(scope="module")
def version_runs(request):
    """version -> (return codes, outputs) of the one process pair that runs, for that version,
    every scenario the session selected; started by the version's first item."""
    runs = {}

    def run(version: str):
        if version not in runs:
            selected = {item.callspec.params["name"] for item in request.session.items
                        if item.originalname == "test_fp4_moe_layer_forward_backward"
                        and item.callspec.params["version"] == version}
            scenarios = {name: SCENARIOS[name][0] for name in SCENARIOS if name in selected}
            timeout_s = sum(SCENARIOS[name][1] for name in scenarios)
            runs[version] = _run_pair(_version_folder(version), version, scenarios, timeout_s)
        return runs[version]

    return run


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU emulation of the CUDA paths")
@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("version", VERSIONS)
def test_fp4_moe_layer_forward_backward(version_runs, version, name):
    _version_folder(version)
    codes, outputs = version_runs(version)
    report = "\n".join(f"--- rank {r} (exit {c}):\n{o[-4000:]}" for r, (c, o) in enumerate(zip(codes, outputs)))
    results = [json.loads(row[len("RESULT "):]) for o in outputs for row in o.splitlines() if row.startswith("RESULT ")]
    mine = [r for r in results if r["scenario"] == name]
    assert [r["rank"] for r in mine] == list(range(WORLD)), report
    failed = [f"rank {r['rank']}: {r['error']}" for r in mine if r["status"] != "ok"]
    assert not failed, "\n".join(failed)
    assert all(r["megatron_core"].split("+")[0] == version for r in mine), report
    assert codes == [0] * WORLD, report


def test_the_matrix_covers_every_release_line_the_start_up_check_accepts():
    from megatron_fp4.options import SUPPORTED_MEGATRON_CORE

    (low_major, low_minor), (high_major, high_minor) = SUPPORTED_MEGATRON_CORE
    assert low_major == high_major == 0, "the range below assumes 0.x lines"
    lines = sorted(tuple(int(n) for n in version.split(".")[:2]) for version in VERSIONS)
    assert lines == [(0, minor) for minor in range(low_minor, high_minor + 1)], (lines, SUPPORTED_MEGATRON_CORE)


@pytest.mark.parametrize("version", VERSIONS)
def test_moe_layer_call_order(version):
    """FP4MoELayer's protocol rests on MoELayer.forward's step order and data flow
    (tests/integration/test_megatron_call_order.py): the same reading of each release's source."""
    from support.megatron_call_order import check_step_calls

    check_step_calls((_version_folder(version) / "megatron" / "core" / "transformer" / "moe" / "moe_layer.py").read_text())


@pytest.mark.parametrize("version", VERSIONS)
def test_training_log_asks_the_moe_tracker_for_its_text(version):
    """--moe-fp4-telemetry reaches the iteration log line through Megatron's MoE metrics tracker
    (megatron_fp4/launch/telemetry_log.py): each release's training_log must append the tracker's
    report to the line, and let the tracker be replaced."""
    import ast
    import inspect

    from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker

    megatron = _version_folder(version) / "megatron"
    training = (megatron / "training" / "training.py").read_text()
    assert "moe_log_string = get_moe_metrics_tracker().report(" in training
    assert "log_string += moe_log_string" in training
    logging = ast.parse((megatron / "core" / "transformer" / "moe" / "moe_logging.py").read_text())
    functions = {node.name: node for node in ast.walk(logging) if isinstance(node, ast.FunctionDef)}
    assert "set_moe_metrics_tracker" in functions
    parameters = [a.arg for a in functions["report"].args.args]
    assert parameters == list(inspect.signature(MoEMetricsTracker.report).parameters), (version, parameters)
