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

By default only W (the forward's operand) is kept. The experts' data gradient takes W^T from it
when backward asks: each 128x128 block of W^T is a block of W transposed with the same scale, so
moving the FP8 bytes (kernels/fp8_transpose_weight.py) gives the bits quantizing W^T would, reading
one byte per element instead of two; it lives only for that GEMM. (torch's own transposing copy of
one-byte elements ran at 7.8% of copy bandwidth on an H200: bench_quantizers' rows.) The FP8 linears
quantize W^T from their weights (their cached W is padded). Memory: one FP8 byte per weight element
(plus an fp32 scale per 128x128 block), held from the first forward of a step to the first forward
of the next, and during backward one linear layer's W^T at a time (the experts': all local experts'
fc2, then fc1).

A cache made with keep_transposed (--moe-fp4-keep-transposed-weights) keeps W^T too, made at the
step's first backward and reused by every later micro-batch's, under the same stamp as W: one more
FP8 byte per weight element, held for the run as W is, as Transformer Engine's FP8 weights keep both.
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


Quantizer = Callable[[Sequence[torch.Tensor], bool], FP8StackedWeights]  # (weights, transpose) -> copy


class FP8WeightCache:
    """One module's quantized weights W (and with keep_transposed W^T), by linear layer name."""

    def __init__(self, keep_transposed: bool = False):
        count_optimizer_steps()  # a copy must not outlive the step that changed its weights
        self.keep_transposed = keep_transposed
        self._entries: Dict[Tuple[str, bool], Tuple[Tuple, FP8StackedWeights]] = {}

    def get(self, name: str, weights: Sequence[torch.Tensor], quantize: Optional[Quantizer] = None
            ) -> FP8StackedWeights:
        """W: the 128x128-block FP8 copy of `weights` (stacked) made by `quantize` (default:
        K.quantize_fp8_weights_stacked), quantized now if the weights changed since the last copy."""
        quantize = quantize or K.quantize_fp8_weights_stacked
        return self._kept((name, False), weights, lambda: quantize(weights, False))

    def get_transposed(self, name: str, weights: Sequence[torch.Tensor], quantize: Optional[Quantizer] = None
                       ) -> FP8StackedWeights:
        """W^T: from the cached W by transposing its blocks (the default quantizer's weights), else by
        `quantize`; kept under keep_transposed, else made for the caller alone."""
        if quantize is None:
            def make():
                return K.transpose_fp8_weights(self.get(name, weights))
        else:
            def make():
                return quantize(weights, True)
        return self._kept((name, True), weights, make) if self.keep_transposed else make()

    def _kept(self, key: Tuple[str, bool], weights: Sequence[torch.Tensor],
              make: Callable[[], FP8StackedWeights]) -> FP8StackedWeights:
        stamp = _stamp(weights)
        entry = self._entries.get(key)
        if entry is None or entry[0] != stamp:
            self._entries.pop(key, None)  # the stale copy is freed before the new one is made
            entry = (stamp, make())
            self._entries[key] = entry
        return entry[1]

    def invalidate(self) -> None:
        self._entries.clear()

    def held_bytes(self) -> int:
        return sum(q.data.numel() + q.block_scales.numel() * 4 for _, q in self._entries.values())


def step_cache(options) -> Optional[FP8WeightCache]:
    """The cache of an FP8 module built with these FP4Options: none under --moe-fp4-weights-per-use,
    else W, and W^T too under --moe-fp4-keep-transposed-weights."""
    return None if options.weights_per_use else FP8WeightCache(options.keep_transposed_weights)


def fp8_weights(cache: Optional[FP8WeightCache], name: str, weights: Sequence[torch.Tensor], transpose: bool,
                quantize: Optional[Quantizer] = None) -> FP8StackedWeights:
    """The FP8 copy a GEMM reads: W, or W^T, from the cache when there is one (FP8WeightCache.get,
    get_transposed), else quantized now by `quantize` (default: K.quantize_fp8_weights_stacked)."""
    if cache is None:
        return (quantize or K.quantize_fp8_weights_stacked)(weights, transpose)
    if transpose:
        return cache.get_transposed(name, weights, quantize)
    return cache.get(name, weights, quantize)
