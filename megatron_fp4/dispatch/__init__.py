"""The FP4 token dispatch: what crosses the expert-parallel all-to-all and how (issue 3)."""

from .all_to_all import GRAD_FORMATS, fp4_dispatch_all_to_all
from .wire import pack_fp8_rows, unpack_fp8_rows

__all__ = ["GRAD_FORMATS", "fp4_dispatch_all_to_all", "pack_fp8_rows", "unpack_fp8_rows"]
