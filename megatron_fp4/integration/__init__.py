"""Glue between megatron_fp4 and Megatron-Core / Megatron training (issue 3)."""

from ..dispatch.options import FP4DispatchOptions
from .args import FP4DispatchUnsupported, add_fp4_args, check_fp4_dispatch_supported
from .experts_spec import EXPERTS_CHOICES, use_fp8_experts
from .moe_layer import FP4MoELayer, count_fp4_moe_layers, use_fp4_dispatch

__all__ = [
    "EXPERTS_CHOICES",
    "FP4DispatchOptions",
    "FP4DispatchUnsupported",
    "FP4MoELayer",
    "add_fp4_args",
    "check_fp4_dispatch_supported",
    "count_fp4_moe_layers",
    "use_fp4_dispatch",
    "use_fp8_experts",
]
