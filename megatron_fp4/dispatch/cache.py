"""The recompute cache: what a checkpointed MoE layer's first (no-grad) pass received through the
FP4 dispatch, kept for its recompute pass so that the dispatch is not sent twice.

One cache per MoE layer. An entry is keyed by the micro-batch: the storage object (StorageImpl),
offset and shape of the layer's input, which Megatron's checkpoint keeps alive between the two
passes and hands back (detached, same storage) to the recompute, so several micro-batches in
flight (pipeline parallelism, virtual stages) each find their own. Not the data address: with
`layernorm` also recomputed, Megatron frees the layer norm's output after forward
(`untyped_storage().resize_(0)`) and re-points the same StorageImpl at the recomputed memory
before the MoE recompute, so the address changes while the storage object does not. The recompute takes its entry out (freed as soon
as its backward has used it); nothing survives a step. A missing, duplicated or mismatched entry
is an error, never a silently wrong tensor.
"""

from dataclasses import dataclass

import torch

from ..tensors import MXFP4Tensor


class DispatchCacheError(RuntimeError):
    """The cache cannot serve this recompute correctly."""


@dataclass(frozen=True)
class MicroBatchKey:
    """Which micro-batch: the MoE layer input's storage object, offset and shape."""

    storage: int  # the StorageImpl's address: stable while the tensor lives, whatever its data pointer
    offset: int
    shape: tuple

    @classmethod
    def of(cls, layer_input: torch.Tensor) -> "MicroBatchKey":
        return cls(layer_input.untyped_storage()._cdata, layer_input.storage_offset(), tuple(layer_input.shape))


@dataclass
class CachedDispatch:
    """What the first pass received: the MXFP4 payload and the dispatcher's handle of that dispatch
    (ReceivedTokens.handle; the all-to-all's: the splits it was sent with), which the recompute
    computes again and must find the same. Not the routing probs: the recompute sends its own (see
    FP4AlltoAllTokenDispatcher.dispatch_fp4)."""

    payload: MXFP4Tensor
    handle: object

    def nbytes(self) -> int:
        return self.payload.rows.numel() * self.payload.rows.element_size()

    def check(self, handle, hidden: int) -> None:
        """Raise unless the recompute routes the same way (handle, width) as the cached pass."""
        if self.handle != handle or self.payload.hidden != hidden:
            raise DispatchCacheError(
                f"the cached dispatch does not match the recompute ({self.handle} vs {handle}, hidden "
                f"{self.payload.hidden} vs {hidden}): routing changed between the passes"
            )


class DispatchCache:
    def __init__(self, name: str = "MoE layer"):
        self.name = name
        self._entries = {}

    def __len__(self) -> int:
        return len(self._entries)

    def nbytes(self) -> int:
        return sum(entry.nbytes() for entry in self._entries.values())

    def store(self, key: MicroBatchKey, entry: CachedDispatch) -> None:
        if key in self._entries:
            raise DispatchCacheError(
                f"{self.name}: a dispatch is already cached for this micro-batch ({key}): its recompute "
                "never ran, so the entry is stale; was backward skipped after a checkpointed forward?"
            )
        self._entries[key] = entry

    def take(self, key: MicroBatchKey) -> CachedDispatch:
        entry = self._entries.pop(key, None)
        if entry is None:
            raise DispatchCacheError(
                f"{self.name}: no cached dispatch for this micro-batch ({key}); {len(self)} other(s) cached. "
                "The recompute pass did not see the input its first pass saw."
            )
        return entry

    def clear(self) -> None:
        self._entries.clear()


__all__ = ["CachedDispatch", "DispatchCache", "DispatchCacheError", "MicroBatchKey"]
