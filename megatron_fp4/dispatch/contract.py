"""What FP4MoELayer needs from a token dispatcher (docs/design.md §4.9), and the values its steps
hand each other.

One pass of the layer (integration/moe_layer.py) runs, in Megatron's MoELayer order:

    dispatch_preprocess / permute_quantized  -> tokens to send (and the probs, or the route)
    dispatch_fp4(tokens, probs, ...)          -> ReceivedTokens (with the dispatch's `handle`)
    experts_input(received, probs, sort_payload) -> ExpertsInput (with the combine's `handle`)
    experts
    combine_preprocess_fp4(output, handle) -> token_combine_fp4(output, handle)
        -> combine_postprocess_fp4(output, handle)

Whatever a later step needs from an earlier one travels in these values, as DeepEP's dispatch
hands its combine a handle: nothing is left on the dispatcher for the combine to find. The
dispatcher itself keeps only what lasts longer than a pass (its configuration, process groups,
the shared experts it overlaps with). Two implementations: the all-to-all dispatcher
(token_dispatcher.py) and the flex dispatcher over DeepEP (flex.py); `factory.py` picks one from
Megatron's dispatcher type.
"""

from dataclasses import dataclass
from typing import Any, Optional, Protocol, Tuple

import torch

from ..tensors import MXFP4Tensor


@dataclass(frozen=True)
class ReceivedTokens:
    """What one dispatch delivered to this rank, rows in the order the wire delivered them.
    tokens: the experts' input, the exact BF16 dequantization of payload (or, when the dispatch
    was asked not to dequantize, a tensor of that shape that only carries the gradient path);
    handle: the dispatcher's own record of this dispatch (what a recompute replays, what the
    combine sends back along)."""

    tokens: torch.Tensor
    payload: MXFP4Tensor
    handle: Any


@dataclass(frozen=True)
class QuantizedPermute:
    """The permute done on MXFP4 rows (the all-to-all dispatcher's permute_quantized).
    tokens: [rows, hidden], in the permuted order, only a gradient path (permute.permuted_stand_in);
    wire: the permuted tokens' MXFP4 rows (None when not asked for: a replayed dispatch sends none);
    source: [num_tokens, hidden], the layer's tokens, whose quantized rows wire holds."""

    tokens: torch.Tensor
    wire: Optional[MXFP4Tensor]
    source: torch.Tensor


@dataclass(frozen=True)
class ExpertsInput:
    """The received tokens as the local experts take them: grouped by local expert, with their
    counts (host) and probs, the payload rows in the same order, and what the combine needs."""

    tokens: torch.Tensor
    tokens_per_expert: torch.Tensor
    probs: torch.Tensor
    payload: Optional[MXFP4Tensor]
    handle: Any


@dataclass(frozen=True)
class PendingCombine:
    """The experts' output on its way back: the tensor of the current combine step and the handle
    that the next step needs."""

    tokens: torch.Tensor
    handle: Any


class FP4Dispatcher(Protocol):
    """The calls FP4MoELayer makes (besides Megatron's dispatch_preprocess and set_shared_experts)."""

    def quantizes_before_permute(self) -> bool:
        """Whether permute_quantized replaces dispatch_preprocess for this configuration."""

    def permute_quantized(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor,
                          quantize: bool) -> Tuple[QuantizedPermute, torch.Tensor]:
        """dispatch_preprocess with the tokens quantized before they are permuted."""

    def dispatch_fp4(self, tokens: torch.Tensor, probs: Any, dequantize: bool, replay=None,
                     wire: Optional[MXFP4Tensor] = None) -> Tuple[ReceivedTokens, Any]:
        """Send the tokens in MXFP4 (or replay a cached dispatch); (ReceivedTokens, received probs)."""

    def experts_input(self, received: ReceivedTokens, probs: Any, sort_payload: bool) -> ExpertsInput:
        """The received rows sorted like the local experts, with the combine's handle; the payload
        sorted the same way only where sort_payload (else ExpertsInput.payload is None)."""

    def combine_preprocess_fp4(self, output: torch.Tensor, handle: Any) -> torch.Tensor:
        """The experts' output back in the order the wire delivered its rows."""

    def token_combine_fp4(self, output: torch.Tensor, handle: Any) -> torch.Tensor:
        """The rows back to the ranks that sent them."""

    def combine_postprocess_fp4(self, output: torch.Tensor, handle: Any) -> torch.Tensor:
        """The layer's output: tokens in their original order and shape, shared experts added."""


__all__ = ["ExpertsInput", "FP4Dispatcher", "PendingCombine", "QuantizedPermute", "ReceivedTokens"]
