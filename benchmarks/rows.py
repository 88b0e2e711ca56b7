"""One line that says where a benchmark ran: GPU, library versions and the commit measured."""

import os
import platform
import subprocess

import torch
import triton


def run_description() -> str:
    # The device machine gets the working tree without git history: pass MEGATRON_FP4_COMMIT.
    commit = os.environ.get("MEGATRON_FP4_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip()
        except OSError:
            commit = ""
    return (f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}, "
            f"Python {platform.python_version()}, commit {commit or 'unknown'}")
