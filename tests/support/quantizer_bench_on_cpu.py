"""TEST SUPPORT ONLY: benchmarks/bench_quantizers.py's main() in a process of its own with torch.cuda
emulated on the CPU (cuda_on_cpu.py, Triton under the interpreter), so that a CPU test runs the
benchmark's own code path (every candidate config, the bit-exactness checks, timing, rows) at a
tiny size. CUDA events time with the host clock.

    python -m support.quantizer_bench_on_cpu ARGS...   # from tests/, the repository root on PYTHONPATH
"""

import sys


def main(argv) -> int:
    from support import cuda_on_cpu

    cuda_on_cpu.install()
    from support.layer_bench_on_cpu import install_timed_events

    install_timed_events()
    import torch

    torch.set_num_threads(1)
    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_name = lambda *args, **kwargs: "cpu (emulated CUDA)"
    torch.cuda._sleep = lambda cycles: None
    from benchmarks import bench_quantizers

    return bench_quantizers.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
