"""The order in which the grouped GEMMs' programs take output tiles (scalar arithmetic only, so the
Triton kernels and the Gluon one call the same function)."""

import triton
import triton.language as tl


@triton.jit
def swizzled(pid, num_tiles_m, num_tiles_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program pid, GROUP_M row tiles side by side so that the weight
    tiles they share are read while still in L2."""
    per_group = GROUP_M * num_tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_size, (pid % per_group) // group_size
