"""The FP4 token dispatch: what crosses the expert-parallel all-to-all and how (issue 3).

The Megatron dispatcher subclass lives in `megatron_fp4.dispatch.token_dispatcher` (it imports
megatron-core); this package's top level needs only torch.
"""

from .all_to_all import fp4_dispatch_all_to_all
from .options import GRAD_FORMATS, FP4DispatchOptions
from .wire import pack_fp8_rows, unpack_fp8_rows

__all__ = ["GRAD_FORMATS", "FP4DispatchOptions", "fp4_dispatch_all_to_all", "pack_fp8_rows", "unpack_fp8_rows"]
