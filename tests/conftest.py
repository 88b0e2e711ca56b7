"""Test setup: on a machine without CUDA the Triton kernels run under the CPU interpreter, the FP8
expert GEMMs under an fp32 emulation (tests/support/scaled_mm_on_cpu.py) and the GPU-only tests
(marker `gpu`) are skipped; with CUDA everything runs on the GPU."""

import os

import torch

if not torch.cuda.is_available():
    # Must be set before any @triton.jit function is defined, i.e. before megatron_fp4 is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from support import interpreter_speedup

    interpreter_speedup.install()

import pytest  # noqa: E402


RANK_PROCESSES = "rank_processes"  # the xdist group of tests/distributed/


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped on CPU-only machines such as CI)")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook turns xdist_group marks into test ids
def pytest_collection_modifyitems(config, items):
    # pytest-xdist's workers, which collect, see --dist loadgroup as this flag (dist reads "no" there).
    if getattr(config.option, "loadgroup", False):
        _group_for_two_workers(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _group_for_two_workers(items) -> None:
    """Units of work for pytest-xdist's --dist loadgroup (the README's command, with
    --no-loadscope-reorder so that units go out in this order): each file is one unit, so that its
    module fixtures run once, except tests/distributed/, whose tests each start a pair of rank
    processes: one unit, first, so that one worker runs those pairs one after another while the
    other worker takes every other file (two pairs at once would only share the two CPU cores)."""
    for item in items:
        distributed = item.path.parent.name == "distributed"
        item.add_marker(pytest.mark.xdist_group(RANK_PROCESSES if distributed else item.nodeid.split("::", 1)[0]))
    items.sort(key=lambda item: item.path.parent.name != "distributed")  # stable: the rest keep their order


@pytest.fixture
def device() -> torch.device:
    """Where kernel tests run: the GPU when there is one, else the CPU through the interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True, scope="session")
def fp8_gemms_emulated_without_cuda():
    """Production refuses FP8 GEMMs off the GPU; without one, tests run them in the emulation."""
    if torch.cuda.is_available():
        yield
        return
    from support import scaled_mm_on_cpu

    scaled_mm_on_cpu.install()
    yield
    scaled_mm_on_cpu.uninstall()
