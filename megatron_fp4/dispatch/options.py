"""What the FP4 dispatcher is asked to do: one small value object, built from Megatron's args."""

from dataclasses import dataclass
from typing import Optional

from ..formats import SCALE_RULES, check_scale_rule

GRAD_FORMATS = ("bf16", "fp8")

# Megatron keeps each over-capacity expert's top tokens by probability, and the no-grad first pass
# and the recompute can compute probs one BF16 unit apart (its router sorts top-k only with grad):
# the kept tokens can differ with the same counts, so a cached payload could be the wrong tokens.
CACHE_WITH_CAPACITY = (
    "--moe-fp4-cache does not support --moe-expert-capacity-factor: with token dropping the recompute can "
    "keep other tokens than the first pass (same counts), so the cached dispatch could be the wrong tokens; "
    "drop one of the two flags."
)


@dataclass(frozen=True)
class FP4DispatchOptions:
    """scale_rule: MXFP4 block scale rule ("ceil" never clips; "floor" is OCP's).
    grad_format: the gradient's format on the reversed all-to-all ("bf16": unquantized in the model's dtype, exact; or "fp8" 1x128).
    cache: keep a checkpointed MoE layer's received payload for its recompute (--moe-fp4-cache).
    saved_input: keep the experts' saved fc1 input as the MXFP4 payload (--moe-fp4-saved-input)."""

    scale_rule: str = "ceil"
    grad_format: str = "bf16"
    cache: bool = False
    saved_input: bool = False

    def __post_init__(self):
        check_scale_rule(self.scale_rule)
        if self.grad_format not in GRAD_FORMATS:
            raise ValueError(f"grad_format must be one of {GRAD_FORMATS}, got {self.grad_format!r}")

    @classmethod
    def from_args(cls, args) -> Optional["FP4DispatchOptions"]:
        """The options `args` (Megatron's parsed arguments) ask for, or None when --moe-fp4-dispatch
        is off: then nothing of this package touches the model."""
        if not getattr(args, "moe_fp4_dispatch", False):
            return None
        return cls(
            scale_rule=getattr(args, "moe_fp4_scale_rule", SCALE_RULES[0]),
            grad_format=getattr(args, "moe_fp4_dispatch_grad", GRAD_FORMATS[0]),
            cache=bool(getattr(args, "moe_fp4_cache", False)),
            saved_input=bool(getattr(args, "moe_fp4_saved_input", False)),
        )


__all__ = ["CACHE_WITH_CAPACITY", "FP4DispatchOptions", "GRAD_FORMATS"]
