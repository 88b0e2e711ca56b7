"""Glue between megatron_fp4 and Megatron-Core / Megatron training (issue 3)."""

from .args import FP4DispatchUnsupported, add_fp4_args, check_fp4_dispatch_supported

__all__ = ["FP4DispatchUnsupported", "add_fp4_args", "check_fp4_dispatch_supported"]
