"""The flex dispatcher's cache replay checks (megatron_fp4/dispatch/flex.py): the recompute must pick
the same experts per token as the cached first pass, in any order within the row (its probs can be a
unit apart, which may swap two experts in the top-k), and its probs are sent in the cached order."""

import pytest
import torch

from megatron_fp4.dispatch.cache import CachedDispatch, DispatchCacheError
from megatron_fp4.dispatch.flex import FlexDispatch, FP4FlexTokenDispatcher, SparseRoute, _in_cached_order
from megatron_fp4.kernels import quantize_mxfp4

HIDDEN = 128


def _replay(cached_indices):
    payload = quantize_mxfp4(torch.randn(cached_indices.shape[0], HIDDEN).bfloat16())
    dispatch = FlexDispatch(None, cached_indices, torch.tensor([1, 1]), torch.Size((3, 1, HIDDEN)), cached_indices)
    return CachedDispatch(payload, dispatch)


def _route(indices, probs):
    return SparseRoute(torch.tensor(indices), torch.tensor(probs), torch.Size((len(indices), 1, HIDDEN)))


def test_a_swapped_top_k_is_the_same_route_and_its_probs_follow_the_cached_order():
    cached = torch.tensor([[3, 1], [0, 2], [2, -1]])
    route = _route([[1, 3], [0, 2], [-1, 2]], [[0.6, 0.4], [0.7, 0.3], [0.0, 1.0]])
    tokens = torch.zeros(3, HIDDEN, dtype=torch.bfloat16)
    assert FP4FlexTokenDispatcher._check_replay(_replay(cached), tokens, route).route_indices is cached
    assert torch.equal(_in_cached_order(route, cached), torch.tensor([[0.4, 0.6], [0.7, 0.3], [1.0, 0.0]]))


def test_other_experts_or_another_shape_are_refused():
    cached = torch.tensor([[3, 1], [0, 2], [2, -1]])
    tokens = torch.zeros(3, HIDDEN, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="routed differently"):
        FP4FlexTokenDispatcher._check_replay(_replay(cached), tokens, _route([[3, 1], [0, 1], [2, -1]],
                                                                           [[0.5, 0.5]] * 3))
    with pytest.raises(DispatchCacheError, match="does not match"):
        FP4FlexTokenDispatcher._check_replay(_replay(cached), torch.zeros(3, 2 * HIDDEN, dtype=torch.bfloat16),
                                             _route([[3, 1], [0, 2], [2, -1]], [[0.5, 0.5]] * 3))
