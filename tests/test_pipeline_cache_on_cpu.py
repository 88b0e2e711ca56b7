"""The recompute cache through Megatron's own pipeline schedules, on CPU: the GPU test's check
(test_gpu_moe_layer._check_cache_pipeline: PP 2, four micro-batches, 1F1B and the interleaved
schedule with two virtual stages per rank; losses and gradients bit-identical with the cache on
and off, no dispatch in any recompute) in two gloo processes, torch.cuda emulated on the CPU
(cuda_on_cpu.py), Megatron's BF16 experts at reduced sizes. This emulation found a bug the GPU run
would have hit (the interleaved schedule reads the chunk's model_type). Stream ordering and NCCL
are the GPU test's to show."""

import os
import sys
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from test_gpu_moe_layer import fail_on_reports

TESTS = os.path.dirname(os.path.abspath(__file__))


def _worker(rank: int, world: int, init_file: str, failures) -> None:
    sys.path.insert(0, TESTS)
    import cuda_on_cpu

    cuda_on_cpu.install()
    import test_gpu_moe_layer as gpu_checks

    gpu_checks.TOKENS_PER_RANK, gpu_checks.HIDDEN = 128, 256  # the interpreter is slow; the logic is the same
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.use_deterministic_algorithms(True, warn_only=True)
    for virtual_stages in (1, 2):
        try:
            gpu_checks._check_cache_pipeline(rank, experts="bf16", virtual_stages=virtual_stages)
        except AssertionError as error:
            failures.put(str(error))
        except BaseException:  # the peer may wait in a collective: report and leave at once
            failures.put(f"rank {rank}, VPP {virtual_stages}: {traceback.format_exc()}")
            failures.close()
            failures.join_thread()
            os._exit(1)
    dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU emulation; on GPUs test_gpu_moe_layer runs the real thing")
def test_cache_through_megatrons_pipeline_schedules_on_cpu():
    failures = mp.get_context("spawn").Queue()
    problem = None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.start_processes(_worker, args=(2, os.path.join(tmp, "init"), failures), nprocs=2, join=True,
                               start_method="spawn")
        except (mp.ProcessExitedException, mp.ProcessRaisedException) as error:
            problem = str(error)
    fail_on_reports(failures, problem)
