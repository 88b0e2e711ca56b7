"""TEST SUPPORT ONLY: benchmarks/bench_moe_layer.py's main() in a process of its own with torch.cuda
emulated on the CPU (cuda_on_cpu.py: one gloo rank, Triton under the interpreter, FP8 GEMMs in
fp32), so that a CPU test runs the benchmark's own code path (layers, checks, timing, rows) at
tiny shapes. CUDA events here time with the host clock (the emulation's return 0 ms, which the
row schema refuses as a reference).

    python -m support.layer_bench_on_cpu ARGS...   # from tests/, the repository root on PYTHONPATH
"""

import sys
import time


def install_timed_events() -> None:
    import torch

    from support import cuda_on_cpu

    class TimedEvent(cuda_on_cpu._Event):
        def __init__(self, *args, **kwargs):
            self.at = None

        def record(self, *args, **kwargs):
            self.at = time.perf_counter()

        def elapsed_time(self, end):
            return (end.at - self.at) * 1000

    torch.cuda.Event = TimedEvent


def main(argv) -> int:
    from support import cuda_on_cpu  # first: it patches torch.cuda before Megatron is imported

    cuda_on_cpu.install()
    install_timed_events()
    import torch

    torch.set_num_threads(1)
    from benchmarks import bench_moe_layer

    return bench_moe_layer.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
