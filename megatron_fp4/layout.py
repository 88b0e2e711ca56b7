"""Where each expert's tokens sit in a colwise (X^T) operand, the wgrad GEMM's (docs/design.md §3.4).

A 1x128 FP8 block along tokens must never mix two experts, so each expert's segment is padded to
whole 128-token blocks and starts at a multiple of 128. The kernels, the experts and the reference
all take these rules from here.
"""

import itertools
from typing import Iterable, List

from .formats import FP8_BLOCK


def colwise_capacity(num_tokens: int, num_experts: int) -> int:
    """Columns of a colwise operand: enough for every expert's segment rounded up to 128 tokens,
    known without reading the per-expert counts (sum ceil128(n_e) <= T + 127 E)."""
    return (num_tokens + (FP8_BLOCK - 1) * num_experts) // FP8_BLOCK * FP8_BLOCK


def padded_segment_offsets(tokens_per_expert: Iterable) -> List[int]:
    """[E + 1]: start of each expert's 128-aligned segment in a colwise operand (counts on the host)."""
    padded = ((int(n) + FP8_BLOCK - 1) // FP8_BLOCK * FP8_BLOCK for n in tokens_per_expert)
    return [0, *itertools.accumulate(padded)]
