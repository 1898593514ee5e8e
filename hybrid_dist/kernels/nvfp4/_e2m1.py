"""E2M1 (NVFP4 element) encoders for the Triton kernels, bitwise ``formats.numerics``:
round to nearest even (``e2m1_rne_bits``; ``e2m1_rne_mad`` adds the code into a packed word;
``e2m1_mag_into`` adds only the magnitude, after ``e2m1_sign_nibbles8`` has placed eight signs)
and stochastic rounding from 8 random bits per element (``e2m1_sr_mad`` with ``sr_noise``;
``e2m1_sr_mag_into`` the magnitude only; ``e2m1_mag_into_rounded`` picks either).
Codes are int32 with the sign in bit 3."""

from __future__ import annotations

import triton
import triton.language as tl

from hybrid_dist.kernels._jit_common import INTERPRET


@triton.jit
def e2m1_rne_ops(v):
    """E2M1 code (int32, sign in bit 3) of fp32 ``v``, magnitude clamped to 6, ties to even:
    bitwise ``numerics.e2m1_encode(v)`` (NaN aside) in ~12 integer/float ops instead of a
    compare chain. ``u >= 1``: round the fp32 bits to one mantissa bit (code = biased
    exponent·2 + mantissa bit − 252); ``u < 1``: ``RNE(2u)`` by adding ``2**23``."""
    u = tl.minimum(tl.abs(v), 6.0)
    b = u.to(tl.int32, bitcast=True)
    hi = (b + (0x1FFFFF - (252 << 22)) + ((b >> 22) & 1)) >> 22
    lo = (u * 2.0 + 8388608.0).to(tl.int32, bitcast=True) & 3
    code = tl.where(u < 1.0, lo, hi)
    return tl.where(v.to(tl.int32, bitcast=True) < 0, code | 8, code)


# PTX: the E2M1 magnitude code of $1 in ``h`` and its sign in ``q``, rounded on the FMA pipe
# (``e2m1_rne_bits``). u = min(|v|, 6), e = max(u, 1); m = 1.5 * 2**22 * 2**E (E: e's exponent);
# r = RNE of u to a multiple of 2**(E-1), times 2**-126; code = bits(r) >> 22. ``_MAGIC`` and
# ``_CODE`` are shared with the stochastic encoder (``_SR_CODE``), which only rounds differently.
_MAGIC = ("abs.f32 u, $1; min.f32 u, u, 0f40C00000; max.f32 e, u, 0f3F800000; "
          "mov.b32 h, e; and.b32 h, h, 2139095040; mov.b32 e, h; mul.rn.f32 m, e, 0f4AC00000; ")
_R126 = "mul.rn.f32 r, r, 0f00800000; mov.b32 h, r; "  # h = bits(r · 2**-126): the code at bit 22
_CODE = _R126 + "shr.u32 h, h, 22; mov.b32 b, $1; setp.lt.s32 q, b, 0; "
_RNE_ROUND = _MAGIC + "add.rn.f32 r, u, m; sub.rn.f32 r, r, m; "
_RNE_CODE = _RNE_ROUND + _CODE
_RNE_BITS_ASM = tl.constexpr("{ .reg .f32 u, e, m, r; .reg .b32 h, b; .reg .pred q; " + _RNE_CODE
                             + "@q or.b32 h, h, 8; mov.b32 $0, h; }")
_RNE_MAD_ASM = tl.constexpr("{ .reg .f32 u, e, m, r; .reg .b32 h, b; .reg .pred q; " + _RNE_CODE
                            + "@q add.s32 h, h, 8; mad.lo.u32 $0, h, $3, $2; }")


@triton.jit
def e2m1_rne_bits(v):
    """``e2m1_rne_ops`` as one PTX block on the GPU (the interpreter runs the ops): the same
    codes (checked on every fp32 in (-8, 8), ``tests/formats/test_e2m1_magic.py``). Opaque to
    LLVM, which otherwise splits the sign select off the code and reassociates it into the
    packing ORs: every code's magnitude then stays live until the signs are merged (157
    instead of 240 registers for one direction at 8 elements per thread).

    The rounding is done by the FMA pipe, the half-rate ALU pipe being the NVFP4 kernels'
    bound on sm_90: with ``E = max(floor(log2 u), 0)``, ``r = (u + m) - m`` for ``m = 1.5 ·
    2**(22+E)`` rounds ``u`` to a multiple of ``2**(E-1)`` with ties to even, which is E2M1's
    grid in that binade (spacing 0.5 below 2); ``r · 2**-126`` puts E2M1's normal/subnormal
    boundary (1) on fp32's (``2**-126``), so its bits are ``code << 22``. 4 ALU instructions
    and 4 FMA-pipe ones per element, against 8 and 1 for the integer rounding of
    ``e2m1_rne_ops``."""
    if INTERPRET:
        return e2m1_rne_ops(v)
    return tl.inline_asm_elementwise(_RNE_BITS_ASM, "=r,f", [v], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def e2m1_rne_mad(v, acc, mult):
    """``acc + e2m1_rne_bits(v) * mult`` (int32; codes land in disjoint nibbles, so the add is
    the packing OR): the packing and the sign are integer multiply-adds (FMA pipe) instead of
    logic ops (ALU pipe, half rate on sm_90, the kernel's bottleneck)."""
    if INTERPRET:
        return acc + e2m1_rne_bits(v) * mult
    return tl.inline_asm_elementwise(_RNE_MAD_ASM, "=r,f,r,r", [v, acc, mult], dtype=tl.int32, is_pure=True, pack=1)


# PTX: ``acc`` plus the E2M1 magnitude code of $1 in nibble ``N`` (``e2m1_mag_into``): the
# code is ``bits(r · 2**-126) >> 22`` with nothing below bit 22, so nibble ``N`` is that word
# shifted right by ``22 - 4N`` (left by ``4N - 22`` for N >= 6), and an add (``LEA.HI``) puts
# it in: one ALU instruction where ``shr`` + ``mad`` took two. The signs are not here: the
# words kernel takes them from the bf16 input's bits, several codes per instruction.
_MAG_BODY = "{ .reg .f32 u, e, m, r; .reg .b32 h; " + _RNE_ROUND + _R126
_MAG_SHR_ASM = tl.constexpr(_MAG_BODY + "shr.b32 h, h, $3; add.u32 $0, h, $2; }")
_MAG_SHL_ASM = tl.constexpr(_MAG_BODY + "shl.b32 h, h, $3; add.u32 $0, h, $2; }")


@triton.jit
def _nibble_shift(v, N: tl.constexpr):
    """The shift count that moves a code at bit 22 to nibble ``N``."""
    return tl.full(v.shape, 22 - 4 * N if 4 * N <= 22 else 4 * N - 22, tl.int32)


@triton.jit
def e2m1_mag_into(v, acc, N: tl.constexpr):
    """``acc + (|code(v)| << 4N)``: the E2M1 magnitude code of fp32 ``v`` (``e2m1_rne_bits``
    without its sign bit) added into nibble ``N`` of int32 ``acc``, whose nibble ``N`` has at
    most its sign bit set: the caller takes the signs from the input's bits."""
    if INTERPRET:
        return acc + ((e2m1_rne_ops(v) & 7) << (4 * N))
    if 4 * N <= 22:
        return tl.inline_asm_elementwise(_MAG_SHR_ASM, "=r,f,r,r", [v, acc, _nibble_shift(v, N)], dtype=tl.int32,
                                         is_pure=True, pack=1)
    return tl.inline_asm_elementwise(_MAG_SHL_ASM, "=r,f,r,r", [v, acc, _nibble_shift(v, N)], dtype=tl.int32,
                                     is_pure=True, pack=1)


# PTX: the sign bits of eight fp32 ``$1..$8`` at bits ``4j + 3`` (``e2m1_sign_nibbles8``). ``prmt``
# in sign-replicate mode (selector nibble ``8 | byte``) makes a byte 0x00 or 0xFF from a
# value's top byte: sets 0, 2, 4, 6 land in bytes 0-3 of ``a``, sets 1, 3, 5, 7 in those of
# ``c``; bit 3 of byte ``b`` is nibble ``2b``'s sign, bit 7 nibble ``2b + 1``'s.
_SIGNS8_ASM = tl.constexpr(
    "{ .reg .b32 a, b, c, d; "
    "prmt.b32 a, $1, $3, 0xFB; prmt.b32 b, $5, $7, 0xFB00; prmt.b32 a, a, b, 0x7610; "
    "prmt.b32 c, $2, $4, 0xFB; prmt.b32 d, $6, $8, 0xFB00; prmt.b32 c, c, d, 0x7610; "
    "and.b32 a, a, 0x08080808; and.b32 c, c, 0x80808080; or.b32 $0, a, c; }")


@triton.jit
def _sign_at(v, N: tl.constexpr):
    return ((v.to(tl.int32, bitcast=True) >> 31) & 1) << (4 * N + 3)


@triton.jit
def e2m1_sign_nibbles8(v0, v1, v2, v3, v4, v5, v6, v7):
    """int32 holding only the sign bits of fp32 ``v_j`` at bit ``4j + 3`` (nibble ``j``'s E2M1
    sign): eight ALU instructions for eight codes (six byte permutes and two logic ops) where a
    shift and a masked OR each took two. ``e2m1_mag_into`` then adds the magnitudes."""
    if INTERPRET:
        return (_sign_at(v0, 0) | _sign_at(v1, 1) | _sign_at(v2, 2) | _sign_at(v3, 3) | _sign_at(v4, 4)
                | _sign_at(v5, 5) | _sign_at(v6, 6) | _sign_at(v7, 7))
    return tl.inline_asm_elementwise(_SIGNS8_ASM, "=r,r,r,r,r,r,r,r,r",
                                     [v0.to(tl.int32, bitcast=True), v1.to(tl.int32, bitcast=True),
                                      v2.to(tl.int32, bitcast=True), v3.to(tl.int32, bitcast=True),
                                      v4.to(tl.int32, bitcast=True), v5.to(tl.int32, bitcast=True),
                                      v6.to(tl.int32, bitcast=True), v7.to(tl.int32, bitcast=True)],
                                     dtype=tl.int32, is_pure=True, pack=1)


# Stochastic rounding with 8 random bits per element (``e2m1_sr_mad``): the noise ``f = 64 + n/2``
# with ``n = (r8 + 1/2) / 256`` is built by one byte permute (``sr_noise``); the encoder adds
# ``gap · n`` to ``u`` and truncates to E2M1's grid, both rounding toward zero, so the code is
# ``hi`` exactly when ``u + gap · n >= hi``: up with probability ``(u - lo) / gap`` rounded to a
# multiple of 1/256 (to nearest, halves up: the noise sits at cell midpoints).
_SR_ROUND = _MAGIC + "sub.rn.f32 t, $2, 0f42800000; fma.rz.f32 s, e, t, u; add.rz.f32 r, s, m; sub.rn.f32 r, r, m; "
_SR_CODE = _SR_ROUND + _CODE
_SR_MAD_ASM = tl.constexpr("{ .reg .f32 u, e, m, t, s, r; .reg .b32 h, b; .reg .pred q; " + _SR_CODE
                           + "@q add.s32 h, h, 8; mad.lo.u32 $0, h, $4, $3; }")
# ``e2m1_sr_mag_into``: ``_SR_ROUND``'s magnitude code added into a nibble, as ``_MAG_*_ASM``
_SR_MAG_BODY = "{ .reg .f32 u, e, m, t, s, r; .reg .b32 h; " + _SR_ROUND + _R126
_SR_MAG_SHR_ASM = tl.constexpr(_SR_MAG_BODY + "shr.b32 h, h, $4; add.u32 $0, h, $3; }")
_SR_MAG_SHL_ASM = tl.constexpr(_SR_MAG_BODY + "shl.b32 h, h, $4; add.u32 $0, h, $3; }")
# prmt: bytes {0x80, w.byte[B], 0x80, 0x42} = fp32 64 + (w.byte[B] + 1/2) / 512; $2 is the
# selector 0x7604 + 16·B (a constant: ptxas folds it into the instruction)
_NOISE_ASM = tl.constexpr("{ .reg .b32 k; mov.b32 k, 1115684992; prmt.b32 $0, $1, k, $2; }")


@triton.jit
def sr_noise(w, B: tl.constexpr):
    """fp32 ``64 + (r8 + 1/2) / 512`` of byte ``B`` (``r8``) of the random int32 words ``w``:
    the stochastic-rounding noise ``e2m1_sr_mad`` takes (one PRMT)."""
    if INTERPRET:
        return ((((w >> (8 * B)) & 0xFF) << 8) | 0x42800080).to(tl.float32, bitcast=True)
    sel = tl.full(w.shape, 0x7604 + 16 * B, tl.int32)
    return tl.inline_asm_elementwise(_NOISE_ASM, "=r,r,r", [w, sel], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def e2m1_sr_ops(v, f):
    """``e2m1_sr_mad``'s code with plain ops (the interpreter's path): ``lo`` = ``u`` truncated
    to E2M1's grid (the top mantissa bit kept; 0 or 0.5 below 1), up when
    ``u - lo >= gap · (1 - n)`` (all exact: ``gap = 2**(E-1)``, ``n`` has 9 bits)."""
    u = tl.minimum(tl.abs(v), 6.0)
    b = u.to(tl.int32, bitcast=True)
    lo = tl.where(u < 1.0, tl.where(u >= 0.5, 0.5, 0.0), (b & 0x7FC00000).to(tl.float32, bitcast=True))
    e = (tl.maximum(u, 1.0).to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    n = (f - 64.0) * 2.0
    code = e2m1_rne_ops(lo) + (u - lo >= e * 0.5 * (1.0 - n)).to(tl.int32)
    return tl.where(v.to(tl.int32, bitcast=True) < 0, code | 8, code)


@triton.jit
def e2m1_sr_mad(v, f, acc, mult):
    """``acc + code * mult`` for the stochastically rounded E2M1 code of fp32 ``v`` (magnitude
    clamped to 6) with the noise ``f`` of ``sr_noise``: ``u + gap · n`` (``gap = 2**(E-1)``,
    E2M1's spacing in ``u``'s binade) by one ``fma.rz``, truncated to the grid by the magic
    add of ``e2m1_rne_bits`` in round-toward-zero. The truncation of a value ``>= hi`` is
    ``hi`` (grid points are fp32), so the code goes up exactly when ``(u - lo) / gap >= 1 - n``:
    ``numerics.e2m1_encode(v, rand)`` with ``rand`` the fp32 just below ``1 - n``
    (``tests/formats/test_e2m1_magic.py``)."""
    if INTERPRET:
        return acc + e2m1_sr_ops(v, f) * mult
    return tl.inline_asm_elementwise(_SR_MAD_ASM, "=r,f,f,r,r", [v, f, acc, mult], dtype=tl.int32, is_pure=True,
                                     pack=1)


@triton.jit
def e2m1_sr_mag_into(v, f, acc, N: tl.constexpr):
    """``acc + (|code| << 4N)`` for the stochastically rounded E2M1 code of fp32 ``v`` with the
    noise ``f`` of ``sr_noise`` (``e2m1_sr_mad``'s rounding, ``e2m1_mag_into``'s packing): the
    magnitude only, the caller places the signs (``e2m1_sign_nibbles8`` or the input's bits)."""
    if INTERPRET:
        return acc + ((e2m1_sr_ops(v, f) & 7) << (4 * N))
    if 4 * N <= 22:
        return tl.inline_asm_elementwise(_SR_MAG_SHR_ASM, "=r,f,f,r,r", [v, f, acc, _nibble_shift(v, N)],
                                         dtype=tl.int32, is_pure=True, pack=1)
    return tl.inline_asm_elementwise(_SR_MAG_SHL_ASM, "=r,f,f,r,r", [v, f, acc, _nibble_shift(v, N)],
                                     dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def e2m1_mag_into_rounded(v, acc, N: tl.constexpr, r, B: tl.constexpr, SR: tl.constexpr):
    """``e2m1_mag_into`` (round to nearest even), or with ``SR`` ``e2m1_sr_mag_into`` with the
    noise of byte ``B`` of the random int32 words ``r`` (``sr_noise``; ``r`` unread without)."""
    if SR:
        return e2m1_sr_mag_into(v, sr_noise(r, B), acc, N)
    return e2m1_mag_into(v, acc, N)
