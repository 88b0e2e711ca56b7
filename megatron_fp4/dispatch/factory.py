"""The FP4 token dispatcher for Megatron's dispatcher type (both implement dispatch/contract.py)."""

from typing import List

from ..options import FP4Options, Route, UnsupportedConfiguration


def fp4_token_dispatcher(num_local_experts: int, local_expert_indices: List[int], config, pg_collection,
                         options: FP4Options, route: Route):
    """alltoall -> FP4AlltoAllTokenDispatcher; flex (DeepEP) -> FP4FlexTokenDispatcher. Each validates
    the configuration against the options table when built."""
    kind = config.moe_token_dispatcher_type
    if kind == "alltoall":
        from .token_dispatcher import FP4AlltoAllTokenDispatcher as dispatcher_class
    elif kind == "flex":
        from .flex import FP4FlexTokenDispatcher as dispatcher_class
    else:
        raise UnsupportedConfiguration(
            f"--moe-fp4-dispatch replaces the alltoall or flex dispatcher's communication (got "
            f"--moe-token-dispatcher-type {kind}).")
    return dispatcher_class(num_local_experts, local_expert_indices, config=config, pg_collection=pg_collection,
                            options=options, route=route)


__all__ = ["fp4_token_dispatcher"]
