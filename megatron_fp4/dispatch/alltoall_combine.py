"""The all-to-all dispatcher's combine, computed from a handle (`AlltoAllCombine`) that the dispatch
phase returns, not from state left on the dispatcher.

The steps and their order are those of Megatron-Core's MoEAlltoAllTokenDispatcher (0.18-0.19):
unsort the rows by source rank (or undo drop-and-pad's layout), the tensor-parallel
reduce-scatter, the all-to-all back with the dispatch's splits swapped, the unpermute (our sums
without atomics where the permute was ours, else Megatron's), the original shape, the shared
experts' output added. tests/distributed compares the layer bit for bit with Megatron's own.
"""

from dataclasses import dataclass
from typing import Any, Optional

import torch
from megatron.core.tensor_parallel import all_to_all, reduce_scatter_to_sequence_parallel_region
from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs, unpermute

from .permute import TokenRows, unpermuted_tokens


@dataclass(frozen=True)
class AlltoAllSplits:
    """The dispatch all-to-all's host splits: rows received from / sent to each EP rank."""

    output_splits: tuple
    input_splits: tuple


@dataclass(frozen=True)
class AlltoAllCombine:
    """What the combine of one pass needs, captured when its dispatch phase ended.
    The splits and counts are the parent's objects as it held them (host arrays after its sync, or
    None where it sends equal shares); token_rows is set where the permute's gradient and the
    unpermute are our atomic-free sums."""

    hidden_shape: torch.Size
    restore_shape: torch.Size
    reversed_mapping: torch.Tensor
    routing_map: torch.Tensor
    token_rows: Optional[TokenRows]
    output_splits: Any
    input_splits: Any
    output_splits_tp: Any
    num_global_tokens_per_local_expert: Any
    capacity: Optional[int]
    probs_dtype: torch.dtype


def unsort_by_source(dispatcher, output: torch.Tensor, handle: AlltoAllCombine) -> torch.Tensor:
    """The experts' rows back in the order the all-to-all delivered them, reduce-scattered over
    tensor-parallel ranks."""
    if dispatcher.one_source_rank():
        return output
    if dispatcher.num_local_experts > 1:
        if dispatcher.drop_and_pad:
            sources = dispatcher.tp_size * dispatcher.ep_size
            output = (output.view(dispatcher.num_local_experts, sources, handle.capacity, *output.shape[1:])
                      .transpose(0, 1).contiguous().flatten(start_dim=0, end_dim=2))
        else:
            output, _ = sort_chunks_by_idxs(output, handle.num_global_tokens_per_local_expert.T.ravel(),
                                            dispatcher.restore_output_by_local_experts,
                                            fused=dispatcher.config.moe_permute_fusion)
    if dispatcher.tp_size > 1:
        splits = None if handle.output_splits_tp is None else handle.output_splits_tp.tolist()
        output = reduce_scatter_to_sequence_parallel_region(
            output.to(handle.probs_dtype), group=dispatcher.tp_group, input_split_sizes=splits).to(output.dtype)
    return output


def send_back(dispatcher, output: torch.Tensor, handle: AlltoAllCombine) -> torch.Tensor:
    """The all-to-all back to the ranks that sent the rows; the shared experts' fc2 right after it."""
    shared = dispatcher.shared_experts
    if shared is not None:
        shared.wait_current_stream()
    output = all_to_all(dispatcher.ep_group, output, handle.input_splits, handle.output_splits,
                        use_nccl_stream=dispatcher.use_nccl_stream)
    if shared is not None:
        shared.linear_fc2_forward(output)
        shared.post_forward_comm()
    return output


def restore_tokens(dispatcher, output: torch.Tensor, handle: AlltoAllCombine) -> torch.Tensor:
    """Each token's rows added back into the token, in the layer input's shape, shared experts added."""
    if handle.token_rows is not None:
        output = unpermuted_tokens(output, handle.token_rows)
    else:
        output = unpermute(output, handle.reversed_mapping, restore_shape=handle.restore_shape,
                           routing_map=handle.routing_map, fused=dispatcher.config.moe_permute_fusion,
                           drop_and_pad=dispatcher.drop_and_pad)
    output = output.view(handle.hidden_shape)
    if dispatcher.shared_experts is not None:
        output += dispatcher.shared_experts.get_output()
    return output


__all__ = ["AlltoAllCombine", "AlltoAllSplits", "restore_tokens", "send_back", "unsort_by_source"]
