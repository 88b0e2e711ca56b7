"""What the tests of our entry points (launch scripts, launcher, `megatron-fp4`) share."""

import sys

# scripts/launch.py starts torchrun from its own interpreter (TORCHRUN unset); the tests run it
# with theirs.
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def one_error_line(stderr: str) -> str:
    """The sentence of a refusal that printed nothing else on stderr (no warning, no traceback)."""
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr[-3000:]
    return lines[0]
