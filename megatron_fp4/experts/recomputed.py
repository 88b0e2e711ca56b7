"""--moe-fp4-recompute-experts for Megatron's own experts (SequentialMLP, TEGroupedMLP): the same
class with its forward inside Megatron's activation checkpoint, which keeps the dispatched BF16
input, the tokens per expert and the probs, and runs the experts again in backward. Our FP8 experts
recompute inside their own autograd function instead (function.py), keeping the MXFP4 payload where
the dispatch feeds them."""

import functools

import torch
from megatron.core import tensor_parallel

from ..options import FP4Options, ModelSettings, Route, validate
from .module import FP8Experts


class _ExpertsRecomputed:
    """Put before an experts class in the bases: its forward, checkpointed in training."""

    def __init__(self, num_local_experts, config, *args, **kwargs):
        # The refusals that read the model's config (`moe` recompute already recomputing the experts,
        # Transformer Engine's FP8, ...), for specs built without our launcher.
        validate(FP4Options(recompute_experts=True), ModelSettings.from_config(config), None, Route.PLUGIN)
        super().__init__(num_local_experts, config, *args, **kwargs)

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs, **kwargs):
        run = functools.partial(super().forward, **kwargs)
        if not (self.training and torch.is_grad_enabled()):
            return run(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        return tensor_parallel.checkpoint(run, False, permuted_local_hidden_states, tokens_per_expert, permuted_probs)


def recomputes_in_backward(experts) -> bool:
    """Whether an experts module keeps only its input and recomputes in backward: ours under
    --moe-fp4-recompute-experts, or Megatron's made so by experts_recomputed."""
    return isinstance(experts, _ExpertsRecomputed) or (isinstance(experts, FP8Experts) and experts.recompute)


@functools.cache
def experts_recomputed(experts_class: type) -> type:
    """`experts_class` with its forward recomputed in backward; the same parameters, checkpoint keys
    and constructor. One class per experts class (an already recomputed one is returned as it is),
    registered in this module under its name so that pickle finds it."""
    if not isinstance(experts_class, type):
        raise TypeError(f"--moe-fp4-recompute-experts: the spec builds the experts with {experts_class!r}, not a "
                        "class")
    if issubclass(experts_class, _ExpertsRecomputed):
        return experts_class
    name = f"{experts_class.__name__}Recomputed"
    recomputed = type(name, (_ExpertsRecomputed, experts_class),
                      {"__module__": __name__, "__qualname__": name,
                       "__doc__": f"{experts_class.__name__}, recomputed in backward (--moe-fp4-recompute-experts)."})
    globals()[name] = recomputed
    return recomputed
