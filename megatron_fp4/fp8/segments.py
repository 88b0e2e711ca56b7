"""Where each segment's tokens sit (a local expert's; a dense FP8 linear has one segment of all its
tokens): rows of the row-major operands, and 128-aligned columns of the colwise (wgrad) operands.
Counts come from the dispatcher, already on the host; the kernels read them, and the row offsets, on
the device."""

import itertools
from dataclasses import dataclass
from typing import Iterator, List, Tuple

import torch

from ..layout import padded_segment_offsets


@dataclass(frozen=True)
class TokenSegments:
    counts: List[int]
    counts_device: torch.Tensor  # int64 [E] on the tokens' device, for the column kernels
    row_offsets: List[int]  # [E + 1]
    row_offsets_device: torch.Tensor  # int64 [E + 1] on the tokens' device, for the grouped GEMMs
    column_offsets: List[int]  # [E + 1], multiples of 128 (the column kernels' layout)

    @classmethod
    def of(cls, tokens_per_expert, device: torch.device) -> "TokenSegments":
        # In Python: the launch of the experts' first kernel waits for this host work.
        counts = [int(n) for n in torch.as_tensor(tokens_per_expert).tolist()]
        if any(n < 0 for n in counts):
            raise ValueError(f"tokens_per_expert must be non-negative, got {counts}")
        rows = [0, *itertools.accumulate(counts)]
        # One pinned copy of counts and offsets goes to the GPU without waiting for it (no host sync).
        both = torch.tensor(counts + rows, dtype=torch.int64, pin_memory=device.type == "cuda")
        both = both.to(device, non_blocking=True)
        return cls(counts, both[: len(counts)], rows, both[len(counts):], padded_segment_offsets(counts))

    @property
    def num_tokens(self) -> int:
        return self.row_offsets[-1]

    def non_empty(self) -> Iterator[Tuple[int, int, int, int, int]]:
        """(segment, first row, end row, first column, end column) of each segment with tokens."""
        for segment, count in enumerate(self.counts):
            if count:
                yield (segment, self.row_offsets[segment], self.row_offsets[segment + 1],
                       self.column_offsets[segment], self.column_offsets[segment + 1])
