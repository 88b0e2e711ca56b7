"""Where each local expert's tokens sit: its rows of the row-major operands. Counts come from the
dispatcher, already on the host; the kernels read them, and the row offsets, on the device."""

from dataclasses import dataclass
from typing import List

import torch


@dataclass(frozen=True)
class ExpertSegments:
    counts: List[int]
    counts_device: torch.Tensor  # int64 [E] on the tokens' device, for the column kernels
    row_offsets: List[int]  # [E + 1]
    row_offsets_device: torch.Tensor  # int64 [E + 1] on the tokens' device, for the grouped GEMMs

    @classmethod
    def of(cls, tokens_per_expert, device: torch.device) -> "ExpertSegments":
        host = torch.as_tensor(tokens_per_expert).detach().to("cpu", torch.int64)
        counts = host.tolist()
        if any(n < 0 for n in counts):
            raise ValueError(f"tokens_per_expert must be non-negative, got {counts}")
        rows = torch.nn.functional.pad(torch.cumsum(host, 0), (1, 0))
        # One pinned copy of counts and offsets goes to the GPU without waiting for it (no host sync).
        both = torch.cat([host, rows])
        if device.type == "cuda":
            both = both.pin_memory().to(device, non_blocking=True)
        return cls(counts, both[: len(counts)], rows.tolist(), both[len(counts):])

    @property
    def num_tokens(self) -> int:
        return self.row_offsets[-1]
