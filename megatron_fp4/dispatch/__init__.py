"""The FP4 token dispatch: what crosses the expert-parallel all-to-all and how.

The Megatron dispatcher subclass lives in `megatron_fp4.dispatch.token_dispatcher` (it imports
megatron-core); this package's top level needs only torch.
"""

from .all_to_all import fp4_dispatch_all_to_all
from .wire import pack_fp8_rows, unpack_fp8_rows

__all__ = ["fp4_dispatch_all_to_all", "pack_fp8_rows", "unpack_fp8_rows"]
