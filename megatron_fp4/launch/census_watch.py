"""The start-up census of a training run that asks for FP4: it cannot be silently off.

`watch(options)` (called where our flags are parsed: the launcher and the plugin's
parse_and_validate_args) records, through torch's global module-registration hook, every module
that gets a TransformerLayer as it is built (a GPT decoder block, a hybrid stack, an MTP layer),
and counts what they hold at the first forward pass of any module once one is recorded: after the
model, optimizer and checkpoint are set up and before the first step completes. It prints one
line (integration.census) on the first rank of each pipeline stage, and stops the run with one
sentence, exit status 2, on every rank whose layers include a stock one where the flags ask for
ours. Both hooks are removed then. With pipeline parallelism only the ranks of a stage holding
stock layers stop: torchrun then ends the others, which otherwise wait for them until the
distributed timeout.
"""

import weakref
from typing import Optional

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

from ..integration.census import census_line, shortfall, take_census
from ..options import FP4Options
from .refusal import refuse

_watch: Optional["_Watch"] = None


def _stage_note() -> str:
    """'' on the rank that speaks for its pipeline stage (' (pipeline stage k of P)' with P > 1);
    None on the others."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return ""
    if ps.get_data_parallel_rank(with_context_parallel=True) != 0 or ps.get_tensor_model_parallel_rank() != 0:
        return None
    stages = ps.get_pipeline_model_parallel_world_size()
    return f" (pipeline stage {ps.get_pipeline_model_parallel_rank()} of {stages})" if stages > 1 else ""


class _Watch:
    def __init__(self, options: FP4Options):
        self.options = options
        self.chunks = weakref.WeakSet()
        self.handles = [torch.nn.modules.module.register_module_module_registration_hook(self._registered),
                        torch.nn.modules.module.register_module_forward_pre_hook(self._first_forward)]

    def _registered(self, module, name, submodule):
        if isinstance(submodule, TransformerLayer):
            self.chunks.add(module)

    def _first_forward(self, module, args):
        if not self.chunks:  # a forward before any model is built: keep watching
            return
        stop()
        census = take_census(list(self.chunks), self.options)
        sentence = shortfall(census, self.options)
        if sentence is not None:
            refuse(sentence)
        note = _stage_note()
        if note is not None:
            print(census_line(census, self.options) + note, flush=True)

    def remove(self):
        for handle in self.handles:
            handle.remove()


def watch(options: FP4Options) -> None:
    """Count the model at its first forward when `options` put our modules in it; replaces an
    earlier watch of this process."""
    global _watch
    stop()
    if options.active:
        _watch = _Watch(options)


def stop() -> None:
    """Remove the hooks (a test process that parses our flags and builds other models after)."""
    global _watch
    if _watch is not None:
        _watch.remove()
        _watch = None


__all__ = ["stop", "watch"]
