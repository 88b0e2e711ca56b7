"""TEST SUPPORT ONLY: a CPU process set up to run Megatron's pretrain() as on a GPU machine, for
the tests that train through a whole training script (ours or a user's stand-in).

torch.cuda is emulated (cuda_on_cpu.py, megatron_training_on_cpu.py), gloo between the ranks.
Three more stand-ins for a CPU process: CUDA available as Megatron's and our start-up checks see it
(Hopper), no torch.compile (Megatron's fused kernels run eagerly) and no pinned-memory data
loading. Call `prepare` before anything imports Megatron."""

import os
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)


def prepare(rank: int, world: int, port: int) -> None:
    sys.path[:0] = [ROOT, TESTS]
    from support import cuda_on_cpu  # before Megatron, which reads torch.cuda at import

    cuda_on_cpu.install()
    from support import megatron_training_on_cpu

    megatron_training_on_cpu.install()
    import torch
    import torch._dynamo

    torch.set_num_threads(1)
    torch._dynamo.config.disable = True  # Megatron's jit_fuser kernels need a GPU to compile; eager instead
    torch.cuda.is_available = lambda: True  # the start-up checks of a GPU machine (cuda_on_cpu: Hopper)
    torch.accelerator.is_available = lambda: False  # no pinned memory for the data loader
    torch.accelerator.current_device_index = lambda: 0
    import megatron.training.initialize as megatron_initialize

    megatron_initialize._warmup_jit_function = lambda *args, **kwargs: None  # compiles Megatron's fusions
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), CUDA_DEVICE_MAX_CONNECTIONS="1")
