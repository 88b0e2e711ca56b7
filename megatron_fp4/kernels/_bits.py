"""Bit-level Triton helpers shared by the kernels.

Every rounding step is done on integers so that the compiled kernels and the CPU interpreter
(TRITON_INTERPRET=1) give the same bytes, whatever either does with float8 casts.
"""

import triton
import triton.language as tl

from ._format_constants import E4M3_NAN

_BYTE3_MSB = tl.constexpr(-0x80000000)  # 0x80000000 as an int32 literal


@triton.jit
def unpack_float_pair(word, KIND: tl.constexpr):
    """One int32 (two 16-bit floats) or int64 (two fp32) -> the two elements as fp32 bit patterns
    (int32), element 2j first. KIND (see _checks.float_kind): 0 bf16, 1 fp16, 2 fp32. bf16 -> fp32
    is a 16-bit shift; fp16 goes through a real convert."""
    if KIND == 0:
        lo = word << 16
        hi = word & -65536  # 0xFFFF0000
    elif KIND == 1:
        lo = (word & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32).to(tl.int32, bitcast=True)
        hi = (word >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32).to(tl.int32, bitcast=True)
    else:
        lo = (word & 0xFFFFFFFF).to(tl.int32)
        hi = (word >> 32).to(tl.int32)
    return lo, hi


@triton.jit
def _load_or_zero(pointers, mask):
    if mask is None:
        return tl.load(pointers)
    else:
        return tl.load(pointers, mask=mask, other=0)


@triton.jit
def load_float_quads(pairs_ptr, quad, mask, KIND: tl.constexpr):
    """Elements 4q .. 4q + 3 of a float tensor as four int32 fp32 bit patterns, for each quad index
    q. pairs_ptr points at the tensor's pair view (_checks.pair_view); 16-bit floats are read as one
    int64 per quad (16-byte vector loads of 8 elements), fp32 as two int64. mask None: no mask.
    Masked elements read as +0."""
    if KIND == 2:
        e0, e1 = unpack_float_pair(_load_or_zero(pairs_ptr + 2 * quad, mask), KIND)
        e2, e3 = unpack_float_pair(_load_or_zero(pairs_ptr + 2 * quad + 1, mask), KIND)
    else:
        word = _load_or_zero(pairs_ptr.to(tl.pointer_type(tl.int64)) + quad, mask)
        e0, e1 = unpack_float_pair(word.to(tl.int32), KIND)  # the low 32 bits
        e2, e3 = unpack_float_pair((word >> 32).to(tl.int32), KIND)
    return e0, e1, e2, e3


@triton.jit
def e4m3_code_bits(v):
    """fp32 v in [0, 448] -> int32 whose bits 0-6 are v's E4M3 code, round to nearest even (E4M3
    subnormals included), bits 7-22 zero and bits 23-30 not (mask or shift them out).

    Three integer operations and one fp32 add instead of an integer rounding (~20 operations):
    adding magic = 2^(e + 20), e = v's binade but at least -6 (E4M3's smallest normal), makes the
    add itself round v to a multiple of 2^(e - 3), E4M3's step there, ties to even. The sum's
    significand counts steps above magic's; magic's low bits 8 * (biased(e) - 121) (a multiple
    of 8, so the tie parity is v's own) turn that count into the code: 8 * (biased(e) - 121) +
    steps, at most 126 since v <= 448. The sum stays inside magic's binade."""
    biased = tl.maximum(v.to(tl.int32, bitcast=True) >> 23, 121)
    magic = biased * ((1 << 23) + 8) + ((20 << 23) - 8 * 121)
    return (v + magic.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True)


@triton.jit
def e4m3_word(e0, e1, e2, e3, inv_scale):
    """Four fp32 bit patterns (int32) times the power of two inv_scale (|x| * inv_scale <= 448) ->
    one int32 of their E4M3 bytes, element 0 in the low byte. Signs are ORed in from the inputs
    (so -0.0 stays 0x80). e4m3_code_bits leaves bits 7-22 zero, so shifts alone clean elements
    2 and 3."""
    c0 = e4m3_code_bits((e0 & 0x7FFFFFFF).to(tl.float32, bitcast=True) * inv_scale)
    c1 = e4m3_code_bits((e1 & 0x7FFFFFFF).to(tl.float32, bitcast=True) * inv_scale)
    c2 = e4m3_code_bits((e2 & 0x7FFFFFFF).to(tl.float32, bitcast=True) * inv_scale)
    c3 = e4m3_code_bits((e3 & 0x7FFFFFFF).to(tl.float32, bitcast=True) * inv_scale)
    word = (c0 & 0x7F) | ((c1 << 8) & 0x7F00) | (c2 << 16) | (c3 << 24)
    signs = ((e0 >> 24) & 0x80) | ((e1 >> 16) & 0x8000) | ((e2 >> 8) & 0x800000) | (e3 & _BYTE3_MSB)
    return word | signs


@triton.jit
def abs_max4(e0, e1, e2, e3):
    """Largest |x| bits of four fp32 bit patterns (NaN / Inf sort above every finite value)."""
    return tl.maximum(tl.maximum(e0 & 0x7FFFFFFF, e1 & 0x7FFFFFFF), tl.maximum(e2 & 0x7FFFFFFF, e3 & 0x7FFFFFFF))


@triton.jit
def rne_shift_right(value, shift):
    """value >> shift rounded to nearest, ties to even (value >= 0, shift >= 1, int32)."""
    shift = tl.minimum(shift, 30)
    kept = value >> shift
    rest = value & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    round_up = (rest > half) | ((rest == half) & ((kept & 1) == 1))
    return kept + round_up.to(tl.int32)


@triton.jit
def e2m1_to_e4m3(code, gap):
    """E4M3 byte of E2M1 code (0..15) times 2^(6 - gap), gap >= 0; exact while gap <= 14,
    round-to-nearest-even into E4M3 subnormals beyond. Zero stays zero (keeping its sign)."""
    magnitude = code & 7
    sign = (code & 8) << 4
    # For magnitude >= 1 the value is sig * 2^(exponent - 8) with sig in {2, 3}.
    exponent = (magnitude >> 1) + 12 - gap
    mantissa = tl.where(magnitude >= 2, (magnitude & 1) << 2, 0)
    normal = (exponent << 3) | mantissa
    sig = tl.where(magnitude >= 2, 2 + (magnitude & 1), 2)
    # Subnormal E4M3 counts units of 2^-9: sig * 2^(exponent + 1).
    subnormal = tl.where(
        exponent >= -1,
        sig << tl.maximum(exponent + 1, 0),
        rne_shift_right(sig, tl.maximum(-exponent - 1, 1)),
    )
    byte = tl.where(exponent >= 1, normal, subnormal)
    return tl.where(magnitude == 0, 0, byte) | sign


@triton.jit
def fp8_block_scale(amax):
    """FP8 scale of a block from the int32 bits of its largest |x| (NaN / Inf bits sort above every
    finite value): the smallest power of two with amax / scale <= 448, never below 2^-126.
    Returns (scale, NaN for a block holding NaN / Inf; 1 / scale; whether the block is NaN)."""
    biased_exp = amax >> 23
    # amax = 1.m * 2^E <= 448 * 2^k = 1.75 * 2^(k + 8): k = E - 8, plus 1 when 1.m > 1.75.
    scale_exp = biased_exp - 8 + ((amax & 0x7FFFFF) > 0x600000).to(tl.int32)
    scale_exp = tl.minimum(tl.maximum(scale_exp, 1), 253)  # biased: scale >= 2^-126
    is_nan = biased_exp == 255  # fp32's all-ones exponent: NaN or Inf
    inv_scale = ((254 - scale_exp) << 23).to(tl.float32, bitcast=True)
    scale = tl.where(is_nan, float("nan"), (scale_exp << 23).to(tl.float32, bitcast=True))
    return scale, inv_scale, is_nan


@triton.jit
def e4m3_to_fp32(byte):
    """fp32 value of an E4M3 byte (int32 0..255); 0x7F / 0xFF are NaN."""
    exponent = (byte >> 3) & 0xF
    mantissa = byte & 7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * 0.001953125  # 2^-9
    value = tl.where(exponent == 0, subnormal, normal)
    value = tl.where((byte & 0x7F) == E4M3_NAN, float("nan"), value)
    # OR the sign bit in: negation may be lowered as 0 - x, which loses the sign of zero.
    return (value.to(tl.int32, bitcast=True) | ((byte & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def fp32_to_bf16_bits(value):
    """bf16 bit pattern (int32 0..65535) of an fp32 value, round to nearest even; NaN -> 0x7FC0."""
    bits = value.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
    return tl.where(value != value, 0x7FC0, rounded)


@triton.jit
def store_rounded(ptr, value, mask, AS_BF16_BITS: tl.constexpr):
    """Store fp32 values rounded to the buffer's type; a BF16 buffer is passed as int16 and rounded
    here to nearest even (Triton's interpreter truncates in .to(tl.bfloat16))."""
    if AS_BF16_BITS:
        tl.store(ptr, fp32_to_bf16_bits(value).to(tl.int16), mask=mask)
    else:
        tl.store(ptr, value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def pow2_fp32(log2_value):
    """2^log2_value as fp32 for int32 log2_value in [-149, 127], built from bits (subnormals too)."""
    normal = ((log2_value + 127) << 23).to(tl.float32, bitcast=True)
    subnormal = (1 << tl.minimum(tl.maximum(log2_value + 149, 0), 22)).to(tl.float32, bitcast=True)
    return tl.where(log2_value >= -126, normal, subnormal)


# --- FP4 -> FP8 on whole 32-bit words: 8 E2M1 codes (one MXFP4 block's slice) at a time --------

_LOW_NIBBLES = tl.constexpr(0x0F0F0F0F)
_BYTE_LSBS = tl.constexpr(0x01010101)
_BYTE_MSBS = tl.constexpr(-0x7F7F7F80)  # 0x80808080 as an int32 literal


@triton.jit
def _fp8_bytes_of_codes_fast(codes, exponent_base):
    """Four E2M1 codes, one per byte (0..15), -> four E4M3 bytes, for a gap of at most 11 (every
    nonzero value is then an E4M3 normal): value 0.5 has byte E << 3 with E = 12 - gap, and each
    code c >= 2 adds c << 2 on top of it. exponent_base = (12 - gap) << 3, the same for all four.
    No byte carries into the next: the largest result is 96 + 28 < 128."""
    magnitude = codes & 0x07070707
    sign = (codes << 4) & _BYTE_MSBS
    nonzero = ((magnitude + 0x7F7F7F7F) >> 7) & _BYTE_LSBS
    at_least_two = ((magnitude + 0x7E7E7E7E) >> 7) & _BYTE_LSBS
    return (nonzero * exponent_base + ((magnitude - nonzero + at_least_two) << 2)) | sign


@triton.jit
def _spread_low_bytes(v):
    """Bytes 0 and 1 of v moved to bytes 0 and 2."""
    return (v & 0xFF) | ((v & 0xFF00) << 8)


@triton.jit
def _interleave_bytes(even, odd):
    """Bytes [e0 e1 e2 e3] and [o0 o1 o2 o3] -> words [e0 o0 e1 o1] and [e2 o2 e3 o3]."""
    first = _spread_low_bytes(even) | (_spread_low_bytes(odd) << 8)
    second = _spread_low_bytes(even >> 16) | (_spread_low_bytes(odd >> 16) << 8)
    return first, second


@triton.jit
def fp4_word_to_fp8_fast(word, gap, is_nan):
    """One int32 of packed E2M1 (elements 0..7, element 0 in the low nibble) whose block sits gap
    (<= 11) below its group's largest scale -> two int32 of E4M3 bytes, elements 0-3 and 4-7."""
    exponent_base = (12 - gap) << 3
    even = _fp8_bytes_of_codes_fast(word & _LOW_NIBBLES, exponent_base)
    odd = _fp8_bytes_of_codes_fast((word >> 4) & _LOW_NIBBLES, exponent_base)
    first, second = _interleave_bytes(even, odd)
    nan4 = E4M3_NAN * _BYTE_LSBS
    return tl.where(is_nan, nan4, first), tl.where(is_nan, nan4, second)


@triton.jit
def fp4_word_to_fp8_exact(word, gap, is_nan):
    """fp4_word_to_fp8_fast for any gap: each code through e2m1_to_e4m3 (E4M3 subnormals)."""
    first = tl.zeros_like(word)
    second = tl.zeros_like(word)
    for n in tl.static_range(4):
        first |= e2m1_to_e4m3((word >> (4 * n)) & 0xF, gap) << (8 * n)
        second |= e2m1_to_e4m3((word >> (4 * n + 16)) & 0xF, gap) << (8 * n)
    nan4 = E4M3_NAN * _BYTE_LSBS
    return tl.where(is_nan, nan4, first), tl.where(is_nan, nan4, second)


@triton.jit
def fp4_words_need_exact_path(word, gap):
    """True where a word holds a nonzero code whose block is more than 11 below its group's top
    (NaN blocks have a negative gap: they never need it)."""
    return ((word & 0x77777777) != 0) & (gap > 11)
