"""Format constants for MXFP4 (OCP MX, E2M1 elements + E8M0 block scales) and FP8 1x128.

docs/design.md §2 (with §3) is normative; this module names its numbers once so that the reference,
the kernels and the tests cannot drift apart.
"""

import enum

import torch

# MXFP4: 32 consecutive elements along the last dimension share one E8M0 scale byte.
MXFP4_BLOCK = 32
E2M1_MAX = 6.0
# Magnitudes of the 3-bit E2M1 codes 0..7; bit 3 of a 4-bit code is the sign.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_SIGN_BIT = 0x8

E8M0_BIAS = 127
E8M0_MAX_FINITE = 254  # largest byte a finite block may get
E8M0_NAN = 255  # a block holding NaN or Inf; dequantizes to NaN

# FP8 side: E4M3 (torch.float8_e4m3fn) with one power-of-two fp32 scale per 1x128 block.
FP8_BLOCK = 128
E4M3_MAX = 448.0
E4M3_NAN = 0x7F  # with the sign bit clear; 0xFF is NaN too
# Four MXFP4 blocks make one FP8 group; the largest E2M1 magnitude (6) times 2^6 is 384 < 448.
FP4_TO_FP8_HEADROOM_LOG2 = 6
# A group whose largest scale byte is S gets the FP8 scale 2^(S - 133).
FP4_TO_FP8_SCALE_BIAS = E8M0_BIAS + FP4_TO_FP8_HEADROOM_LOG2
# A gap d between a block's scale byte and its group's largest one is exact while d <= 14.
FP4_TO_FP8_EXACT_MAX_GAP = 14

# Storage sizes in bytes.
E2M1_BYTES = 0.5  # two elements per byte
E8M0_BYTES = 1
E4M3_BYTES = 1
FP8_SCALE_BYTES = 4  # one fp32 per block
# Per element, scales included (the estimator's unit).
MXFP4_BYTES_PER_ELEMENT = E2M1_BYTES + E8M0_BYTES / MXFP4_BLOCK  # 0.53125
FP8_1X128_BYTES_PER_ELEMENT = E4M3_BYTES + FP8_SCALE_BYTES / FP8_BLOCK  # 1.03125
FP8_128X128_BYTES_PER_ELEMENT = E4M3_BYTES + FP8_SCALE_BYTES / (FP8_BLOCK * FP8_BLOCK)  # weights
# Transformer Engine's MXFP8 (E4M3 elements, one E8M0 byte per 32): only the estimator needs it.
MXFP8_BYTES_PER_ELEMENT = E4M3_BYTES + E8M0_BYTES / MXFP4_BLOCK

class ScaleRule(enum.StrEnum):
    """How an MXFP4 block's E8M0 scale is chosen from its amax."""

    CEIL = "ceil"  # 2^ceil(log2(amax / 6)): never clips (the default)
    FLOOR = "floor"  # OCP: 2^(floor(log2(amax)) - 2), saturates at 6


SCALE_RULES = tuple(rule.value for rule in ScaleRule)

# Input dtypes the quantizers accept.
FLOAT_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def mxfp4_wire_bytes_per_row(hidden: int) -> int:
    """Bytes of one token on the wire: packed E2M1 data followed by its E8M0 scales."""
    return hidden // 2 + E8M0_BYTES * (hidden // MXFP4_BLOCK)


def fp8_wire_bytes_per_row(hidden: int) -> int:
    """Bytes of one FP8 1x128 token on the wire: E4M3 data followed by its fp32 scales' bytes."""
    return E4M3_BYTES * hidden + FP8_SCALE_BYTES * (hidden // FP8_BLOCK)


def check_scale_rule(scale_rule: str) -> None:
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
