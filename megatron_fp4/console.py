"""What our command-line entry points share (`megatron-fp4`, scripts/launch.py, the training
launcher): an error is one line `error: <sentence>` on stderr with exit status 2, and the notices
that third-party packages print on import are kept out of the way.

`quiet_third_party_notices()` is for our entry points only, called before they import Megatron;
importing megatron_fp4 as a library changes no warning filter.
"""

import logging
import sys
import warnings

# What megatron-core says when it is imported without Transformer Engine, apex or absl: our launcher
# then picks Megatron's local layers and torch's kernels itself (its --help lists the defaults it
# changed), so these say nothing the user has to act on. Regular expressions matched against the
# start of a UserWarning's message.
THIRD_PARTY_WARNINGS = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"absl\.logging is not installed",
    r"Only transformer-engine>=\S+ supports MoE experts",
)
# torch.utils.cpp_extension logs this on import on a machine without a CUDA runtime.
NO_CUDA_RUNTIME = "No CUDA runtime is found"


def _not_the_cuda_runtime_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(NO_CUDA_RUNTIME)


def quiet_third_party_notices() -> None:
    """Ignore the import-time notices above (and only those) in this process."""
    for message in THIRD_PARTY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    logging.getLogger("torch.utils.cpp_extension").addFilter(_not_the_cuda_runtime_notice)


def fail(sentence: str) -> int:
    """Print `error: <sentence>` on stderr; returns 2, the exit status of a refusal."""
    print(f"error: {sentence}", file=sys.stderr, flush=True)
    return 2
