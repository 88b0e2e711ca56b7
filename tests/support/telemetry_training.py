"""TEST SUPPORT ONLY: one rank of a tiny MoE GPT trained by our launcher (megatron_fp4.launch's
main, Megatron's pretrain() and training loop) on the CPU, run as its own process:

    python tests/support/telemetry_training.py RANK WORLD PORT OUT_JSON [extra launcher flags]

The process is set up as a GPU machine by training_on_cpu.py, EP = WORLD. Megatron's TensorBoard
and W&B writers are stand-ins that record what they are given.

OUT_JSON gets, per rank: Megatron's iteration log lines (stdout), the scalars written to both
writers, and the host reads (Tensor.item, .tolist, .numpy, .cpu, bool/int/float of a tensor) made
during each step's forward and backward passes (Megatron's forward_backward_func), each with
whether megatron_fp4/telemetry.py made it."""

import contextlib
import io
import json
import os
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)

# The model: 1 MoE layer, hidden 128, 2 experts top-2 (each token goes to both, so each rank of
# EP 2 receives exactly the rows it sends), 2 micro-batches of 2 x 16 tokens per rank and step.
HIDDEN, SEQ, MICRO_BATCH, GLOBAL_BATCH, EXPERTS, TOPK, ITERATIONS = 128, 16, 2, 4, 2, 2, 2
LAUNCHER_ARGV = [
    "--num-layers", "1", "--hidden-size", str(HIDDEN), "--ffn-hidden-size", "256", "--num-attention-heads", "2",
    "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--position-embedding-type", "rope",
    "--micro-batch-size", str(MICRO_BATCH), "--train-iters", str(ITERATIONS), "--lr", "1e-4",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
    "--num-experts", str(EXPERTS), "--moe-router-topk", str(TOPK), "--moe-ffn-hidden-size", "128",
    "--moe-token-dispatcher-type", "alltoall", "--swiglu", "--disable-bias-linear", "--bf16",
    "--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
    "--no-persist-layer-norm", "--no-rope-fusion", "--distributed-backend", "gloo", "--log-interval", "1",
    "--eval-iters", "0", "--seed", "1234",
]
HOST_READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")


class Writer:
    """Stands for TensorBoard's SummaryWriter and for a W&B run: keeps every scalar."""

    def __init__(self):
        self.scalars = []
        self.config = self  # W&B's run.config.update(...)

    def add_scalar(self, name, value, step, *args, **kwargs):
        self.scalars.append([name, float(value), int(step)])

    def log(self, values: dict, step=None, *args, **kwargs):
        self.scalars.extend([name, float(value), int(step)] for name, value in values.items())

    def update(self, *args, **kwargs):
        pass

    def flush(self):
        pass

    def finish(self):
        pass


def _telemetry_on_the_stack() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.endswith(os.path.join("megatron_fp4", "telemetry.py")):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def counting_host_reads(reads: list):
    """Appends to `reads`, per host read of a tensor made meanwhile, its name and whether
    megatron_fp4/telemetry.py is on the stack."""
    import torch

    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counted(name, original):
        def read(self, *args, **kwargs):
            reads.append([name, _telemetry_on_the_stack()])
            return original(self, *args, **kwargs)
        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, counted(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def main(rank: int, world: int, port: int, out_json: str, extra: list) -> None:
    sys.path[:0] = [ROOT, TESTS]
    from support import training_on_cpu

    training_on_cpu.prepare(rank, world, port)
    from megatron.training import training

    writers = {"tensorboard": Writer(), "wandb": Writer()}
    training.get_tensorboard_writer = lambda: writers["tensorboard"]
    training.get_wandb_writer = lambda: writers["wandb"]
    reads_per_step = []
    get_forward_backward_func = training.get_forward_backward_func

    def counting_forward_backward_func(*args, **kwargs):
        forward_backward = get_forward_backward_func(*args, **kwargs)

        def run(*a, **k):
            reads_per_step.append([])
            with counting_host_reads(reads_per_step[-1]):
                return forward_backward(*a, **k)
        return run

    training.get_forward_backward_func = counting_forward_backward_func
    sys.argv = ["pretrain_gpt_fp4.py", *LAUNCHER_ARGV, "--expert-model-parallel-size", str(world),
                "--global-batch-size", str(GLOBAL_BATCH * world), *extra]
    from megatron_fp4.launch import main as launcher_main

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        launcher_main()
    log_lines = [line for line in stdout.getvalue().splitlines() if " iteration " in line]
    with open(out_json, "w") as f:
        json.dump({"rank": rank, "log_lines": log_lines,
                   "scalars": {name: writer.scalars for name, writer in writers.items()},
                   "host_reads_per_step": [sorted(reads) for reads in reads_per_step]}, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5:])
