"""The columnwise RHT of ``nvfp4.words`` (1×16 blocks along M, bf16 words): the random signs
applied while the words are unpacked, the Sylvester butterflies without the ``1/4`` (which
moves onto the block scale), the block amax taken from the last butterfly stage, and the codes
encoded with their signs taken from the transformed values' bits.

[Note: unscaled butterflies] ``T = H16 · diag(s) / 4`` (``formats.numerics.hadamard16``;
the kernel reads ``T[0, :] = s / 4``). The tile kernel (``tiles._rht16``) forms
``y = T x`` as ``x_q · T[0, q]`` and four stages of adds. Here ``s_q`` goes into ``x_q``'s sign
bit as the word is unpacked and the butterflies run on ``z = H16 (s ∘ x)``. Then ``z = 4y``
bitwise: the tile kernel's products ``x_q / 4`` are exact multiples of ``2**-135``, as is every
sum of them, so no subnormal sum rounds, and among normal numbers rounding commutes with the
factor 4, as long as ``z`` does not overflow: every ``|x| < 2**124``. The block amax is
``max_p |z_p| / 4`` and the encode multiplier ``enc / 4`` (both exact there), so
``RN(z_p · enc/4) = RN(y_p · enc)``: the tile kernel's codes and scales, bitwise.

Block amax: for the last stage's pair ``(a, b)`` (outputs ``a ± b``),
``max(|RN(a + b)|, |RN(a − b)|) = RN(|a| + |b|)`` (RN is monotone and odd): 8 adds and 7
maxima for 16 values. NaN and inf give the same maximum either way.

Codes: ``_e2m1.e2m1_mag_into`` adds each magnitude into its nibble after
``e2m1_sign_nibbles8`` has put eight signs in place. A code's sign is ``z``'s sign bit, the
sign of ``z · enc/4`` except where that product is NaN (``inf · 0``: a block with an inf
input, "NaN aside" in every comparison with the reference).
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybrid_dist.kernels.nvfp4._e2m1 import e2m1_mag_into_rounded, e2m1_sign_nibbles8
from hybrid_dist.kernels._jit_common import nvfp4_block_scale as _block_scale


@triton.jit
def _sign_bit(t_ptr, q: tl.constexpr):
    return tl.load(t_ptr + q).to(tl.int32, bitcast=True) & -2147483648


@triton.jit
def rht_signs16(t_ptr):
    """The signs ``s_q`` as int32 bit 31 (``t_ptr``: fp32 ``T[0, :] = s / 4``)."""
    return (_sign_bit(t_ptr, 0), _sign_bit(t_ptr, 1), _sign_bit(t_ptr, 2), _sign_bit(t_ptr, 3),
            _sign_bit(t_ptr, 4), _sign_bit(t_ptr, 5), _sign_bit(t_ptr, 6), _sign_bit(t_ptr, 7),
            _sign_bit(t_ptr, 8), _sign_bit(t_ptr, 9), _sign_bit(t_ptr, 10), _sign_bit(t_ptr, 11),
            _sign_bit(t_ptr, 12), _sign_bit(t_ptr, 13), _sign_bit(t_ptr, 14), _sign_bit(t_ptr, 15))


@triton.jit
def signed_half(w, sign, HIGH: tl.constexpr):
    """fp32 of the low (even k) or high (odd k) halves of bf16 words ``w``, negated where
    ``sign`` (bit 31) is set: an add of bit 31 is its XOR."""
    if HIGH:
        return ((w & -65536) ^ sign).to(tl.float32, bitcast=True)
    else:
        return ((w << 16) + sign).to(tl.float32, bitcast=True)


@triton.jit
def _stage(a, b):
    return a + b, a - b


@triton.jit
def wht16_amax(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15):
    """``z = H16 x`` over the 16 sets (``H16[p, q] = (-1)^popcount(p & q)``, no scaling; the
    tile kernel's butterfly order) and ``max_p |z_p|`` (note "unscaled butterflies")."""
    x0, x1 = _stage(x0, x1)
    x2, x3 = _stage(x2, x3)
    x4, x5 = _stage(x4, x5)
    x6, x7 = _stage(x6, x7)
    x8, x9 = _stage(x8, x9)
    x10, x11 = _stage(x10, x11)
    x12, x13 = _stage(x12, x13)
    x14, x15 = _stage(x14, x15)
    x0, x2 = _stage(x0, x2)
    x1, x3 = _stage(x1, x3)
    x4, x6 = _stage(x4, x6)
    x5, x7 = _stage(x5, x7)
    x8, x10 = _stage(x8, x10)
    x9, x11 = _stage(x9, x11)
    x12, x14 = _stage(x12, x14)
    x13, x15 = _stage(x13, x15)
    x0, x4 = _stage(x0, x4)
    x1, x5 = _stage(x1, x5)
    x2, x6 = _stage(x2, x6)
    x3, x7 = _stage(x3, x7)
    x8, x12 = _stage(x8, x12)
    x9, x13 = _stage(x9, x13)
    x10, x14 = _stage(x10, x14)
    x11, x15 = _stage(x11, x15)
    m0 = tl.maximum(tl.abs(x0) + tl.abs(x8), tl.abs(x1) + tl.abs(x9))
    m1 = tl.maximum(tl.abs(x2) + tl.abs(x10), tl.abs(x3) + tl.abs(x11))
    m2 = tl.maximum(tl.abs(x4) + tl.abs(x12), tl.abs(x5) + tl.abs(x13))
    m3 = tl.maximum(tl.abs(x6) + tl.abs(x14), tl.abs(x7) + tl.abs(x15))
    amax = tl.maximum(tl.maximum(m0, m1), tl.maximum(m2, m3))
    x0, x8 = _stage(x0, x8)
    x1, x9 = _stage(x1, x9)
    x2, x10 = _stage(x2, x10)
    x3, x11 = _stage(x3, x11)
    x4, x12 = _stage(x4, x12)
    x5, x13 = _stage(x5, x13)
    x6, x14 = _stage(x6, x14)
    x7, x15 = _stage(x7, x15)
    return x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, amax


@triton.jit
def codes8_signed(z0, z1, z2, z3, z4, z5, z6, z7, enc, r_a, r_b, SR: tl.constexpr):
    """E2M1 codes of ``z_j · enc`` packed into one int32 (set ``j`` in nibble ``j``), each
    sign from ``z_j``'s bits; ``SR``: set ``j``'s noise from byte ``j % 4`` of the random words
    ``r_a`` (sets 0-3) or ``r_b`` (sets 4-7)."""
    acc = e2m1_sign_nibbles8(z0, z1, z2, z3, z4, z5, z6, z7)
    acc = e2m1_mag_into_rounded(z0 * enc, acc, 0, r_a, 0, SR)
    acc = e2m1_mag_into_rounded(z1 * enc, acc, 1, r_a, 1, SR)
    acc = e2m1_mag_into_rounded(z2 * enc, acc, 2, r_a, 2, SR)
    acc = e2m1_mag_into_rounded(z3 * enc, acc, 3, r_a, 3, SR)
    acc = e2m1_mag_into_rounded(z4 * enc, acc, 4, r_b, 0, SR)
    acc = e2m1_mag_into_rounded(z5 * enc, acc, 5, r_b, 1, SR)
    acc = e2m1_mag_into_rounded(z6 * enc, acc, 6, r_b, 2, SR)
    return e2m1_mag_into_rounded(z7 * enc, acc, 7, r_b, 3, SR)


@triton.jit
def rht_half_codes(w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15,
                   s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15, gs,
                   seed, ctr, HIGH: tl.constexpr, SR: tl.constexpr):
    """Columnwise of one half (even or odd k) of the 16 sets' words in the Hadamard domain:
    block scales (E4M3, ``w``'s shape) and the codes of sets 0-7 (``c_lo``) and 8-15
    (``c_hi``), set ``j`` in nibble ``j % 8``; bitwise the tile kernel's columnwise RHT
    (``tiles._cols16``) for ``|x| < 2**124``.
    ``s_q``: set ``q``'s sign (``rht_signs16``). ``SR``: stochastic rounding, set ``q`` taking
    byte ``q % 4`` of word ``q / 4`` of ``tl.randint4x(seed, ctr)`` (uint32 Philox counters of
    this half's columns: the tile kernel's stream)."""
    z0, z1, z2, z3, z4, z5, z6, z7, z8, z9, z10, z11, z12, z13, z14, z15, amax = wht16_amax(
        signed_half(w0, s0, HIGH), signed_half(w1, s1, HIGH), signed_half(w2, s2, HIGH),
        signed_half(w3, s3, HIGH), signed_half(w4, s4, HIGH), signed_half(w5, s5, HIGH),
        signed_half(w6, s6, HIGH), signed_half(w7, s7, HIGH), signed_half(w8, s8, HIGH),
        signed_half(w9, s9, HIGH), signed_half(w10, s10, HIGH), signed_half(w11, s11, HIGH),
        signed_half(w12, s12, HIGH), signed_half(w13, s13, HIGH), signed_half(w14, s14, HIGH),
        signed_half(w15, s15, HIGH))
    bs, enc = _block_scale(amax * 0.25, gs)
    enc = enc * 0.25
    r0, r1, r2, r3 = ctr, ctr, ctr, ctr  # unused without SR
    if SR:
        r0, r1, r2, r3 = tl.randint4x(seed, ctr)
    c_lo = codes8_signed(z0, z1, z2, z3, z4, z5, z6, z7, enc, r0, r1, SR)
    c_hi = codes8_signed(z8, z9, z10, z11, z12, z13, z14, z15, enc, r2, r3, SR)
    return bs, c_lo, c_hi


@triton.jit
def rht_columns(w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15, t_ptr, gs,
                seed, ctr, SR: tl.constexpr):
    """``rht_half_codes`` of both halves: ``(bs_even, c_lo_even, c_hi_even, bs_odd, c_lo_odd,
    c_hi_odd)``; ``t_ptr``: fp32 ``T[0, :]`` (its signs are read once for both). ``SR``: the
    even half's Philox counters are ``ctr`` (uint32, ``w``'s shape), the odd half's ``ctr + 1``."""
    s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15 = rht_signs16(t_ptr)
    bs_e, e_lo, e_hi = rht_half_codes(w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15,
                                      s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15, gs,
                                      seed, ctr, False, SR)
    bs_o, o_lo, o_hi = rht_half_codes(w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15,
                                      s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15, gs,
                                      seed, ctr + 1, True, SR)
    return bs_e, e_lo, e_hi, bs_o, o_lo, o_hi
