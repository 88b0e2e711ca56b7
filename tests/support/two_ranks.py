"""Run one scenario function on both ranks of a two-process group: NCCL on the first two GPUs, or
gloo on the CPU with torch.cuda emulated (cuda_on_cpu.py; stream ordering and NCCL are the GPU
run's to show). The function, named by its dotted path, is called as function(rank, scratch,
*arguments), scratch a folder both ranks share for the call.

A failed assertion on either rank fails the test with every rank's message; a rank that raises
anything else leaves at once (its peer may wait in a collective); ranks still running after
timeout_s are killed, after dumping their stacks, and the test fails.
"""

import datetime
import faulthandler
import importlib
import os
import sys
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worker(rank, world, scratch, failures, target, arguments, emulated, timeout_s):
    sys.path.insert(0, TESTS)
    if emulated:
        from support import cuda_on_cpu  # first: it patches torch.cuda before Megatron is imported

        cuda_on_cpu.install()
        torch.set_num_threads(1)
    faulthandler.dump_traceback_later(max(timeout_s - 15, 5), exit=False)
    init_file = os.path.join(scratch, "init")
    if emulated:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank), timeout=datetime.timedelta(seconds=timeout_s))
    # index_add / scatter_add in Megatron's (un)permute use atomics unless deterministic.
    torch.use_deterministic_algorithms(True, warn_only=True)
    module, function = target.rsplit(".", 1)
    scenario = f"{target}{arguments}"
    start = time.monotonic()
    try:
        getattr(importlib.import_module(module), function)(rank, scratch, *arguments)
    except AssertionError as error:
        failures.put(f"rank {rank}: {error}")
    except BaseException:
        print(f"rank {rank}: {scenario} raised\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        failures.put(f"rank {rank}: {scenario} raised {traceback.format_exc(limit=-3)}")
        failures.close()
        failures.join_thread()
        os._exit(1)
    print(f"rank {rank}: {scenario} done in {time.monotonic() - start:.1f} s", flush=True)
    faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()


def run_on_two_ranks(target: str, *arguments, emulated: bool, timeout_s: int) -> None:
    for knob, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                        ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(knob, value)
    failures = mp.get_context("spawn").Queue()
    problem = None
    with tempfile.TemporaryDirectory() as tmp:
        processes = mp.start_processes(
            _worker, args=(2, tmp, failures, target, arguments, emulated, timeout_s),
            nprocs=2, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not processes.join(timeout=5):
                if time.monotonic() > deadline:
                    for process in processes.processes:
                        process.kill()
                    problem = f"{target}{arguments}: the ranks did not finish in {timeout_s} s (stuck in communication?)"
                    break
        except (mp.ProcessExitedException, mp.ProcessRaisedException) as error:
            problem = str(error)
    fail_on_reports(failures, problem)


def fail_on_reports(failures, problem=None) -> None:
    """Fail the test with `problem` and every message the ranks put in `failures`, if any."""
    found = [problem] if problem else []
    while not failures.empty():
        found.append(failures.get())
    if found:
        pytest.fail("\n".join(found))
