"""The FP8 weights of the experts and of the FP8 linears, quantized once per optimizer step and
reused by every micro-batch.

A copy is reused only while its stamp matches: the number of optimizer steps taken in this process
(torch's global step hook, installed when the first cache is made: every optimizer Megatron builds,
torch's Adam, Apex's or Transformer Engine's fused Adam, steps through torch.optim.Optimizer.step)
and each weight's address and in-place version (a load_state_dict or another in-place write through
autograd bumps it). Megatron's distributed optimizer writes the new values into the weights after
its inner step and, with --overlap-param-gather, all-gathers them in the layers' forward pre-hooks,
which the experts run before asking for their weights: so the first forward after a step
re-quantizes, from the new values. Writes that bypass both (a plain `param.data.copy_()` outside an
optimizer step) are not seen: call `invalidate()` after them.

Only W (the forward's operand) is kept. The experts' data gradient takes W^T from it when backward
asks: each 128x128 block of W^T is a block of W transposed with the same scale, so moving the FP8
bytes (kernels/fp8_transpose_weight.py) gives the bits quantizing W^T would, reading one byte per
element instead of two; it lives only for that GEMM. (torch's own transposing copy of one-byte
elements ran at 7.8% of copy bandwidth on an H200: bench_quantizers' rows.) The FP8 linears quantize
W^T from their weights (their cached W is padded). Memory: one FP8 byte per weight element (plus an
fp32 scale per 128x128 block), held from the first forward of a step to the first forward of the
next, and during backward one linear layer's W^T at a time (the experts': all local experts' fc2,
then fc1).
"""

from typing import Callable, Dict, Optional, Sequence, Tuple

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from .. import kernels as K
from ..tensors import FP8StackedWeights

_optimizer_steps = 0
_counting = False


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


def count_optimizer_steps() -> None:
    """Install the process-wide optimizer step hook that the caches' stamps read, once (later calls
    do nothing). Every FP8WeightCache calls it when made, so the experts and linears that build
    one install it, and importing this module installs nothing."""
    global _counting
    if not _counting:
        register_optimizer_step_post_hook(_count_optimizer_step)
        _counting = True


def optimizer_steps() -> int:
    """Optimizer steps taken in this process (any torch optimizer) since count_optimizer_steps."""
    return _optimizer_steps


def _stamp(weights: Sequence[torch.Tensor]) -> Tuple:
    return (_optimizer_steps,) + tuple((w.data_ptr(), w._version) for w in weights)


class FP8WeightCache:
    """One module's quantized weights W, by linear layer name."""

    def __init__(self):
        count_optimizer_steps()  # a copy must not outlive the step that changed its weights
        self._entries: Dict[str, Tuple[Tuple, FP8StackedWeights]] = {}

    def get(self, name: str, weights: Sequence[torch.Tensor],
            quantize: Optional[Callable[[Sequence[torch.Tensor], bool], FP8StackedWeights]] = None
            ) -> FP8StackedWeights:
        """W: the 128x128-block FP8 copy of `weights` (stacked) made by `quantize` (default:
        K.quantize_fp8_weights_stacked), quantized now if the weights changed since the last copy."""
        quantize = quantize or K.quantize_fp8_weights_stacked
        stamp = _stamp(weights)
        entry = self._entries.get(name)
        if entry is None or entry[0] != stamp:
            entry = (stamp, quantize(weights, False))
            self._entries[name] = entry
        return entry[1]

    def invalidate(self) -> None:
        self._entries.clear()

    def held_bytes(self) -> int:
        return sum(q.data.numel() + q.block_scales.numel() * 4 for _, q in self._entries.values())


def fp8_weights(cache: Optional[FP8WeightCache], name: str, weights: Sequence[torch.Tensor], transpose: bool,
                quantize: Optional[Callable[[Sequence[torch.Tensor], bool], FP8StackedWeights]] = None
                ) -> FP8StackedWeights:
    """The FP8 copy a GEMM reads: W from the cache when there is one; W^T from the cached W by
    transposing its blocks (the default, stacked quantizer's weights), else quantized now, as is W
    without a cache; W^T is held only for its one GEMM. `quantize` as in FP8WeightCache.get."""
    if cache is None:
        return (quantize or K.quantize_fp8_weights_stacked)(weights, transpose)
    if not transpose:
        return cache.get(name, weights, quantize)
    if quantize is None:
        return K.transpose_fp8_weights(cache.get(name, weights))
    return quantize(weights, True)
