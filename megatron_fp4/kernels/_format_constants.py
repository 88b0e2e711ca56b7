"""The numbers of formats.py that kernel bodies use, as Triton constexprs: a @triton.jit function
may read a module global only when it is one (compiled and interpreted alike)."""

import triton.language as tl

from .. import formats

E8M0_NAN = tl.constexpr(formats.E8M0_NAN)
E8M0_MAX_FINITE = tl.constexpr(formats.E8M0_MAX_FINITE)
E4M3_NAN = tl.constexpr(formats.E4M3_NAN)
FP4_TO_FP8_SCALE_BIAS = tl.constexpr(formats.FP4_TO_FP8_SCALE_BIAS)
