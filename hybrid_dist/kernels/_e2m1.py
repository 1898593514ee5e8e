"""E2M1 (NVFP4 element) encoders for the Triton kernels, bitwise ``formats._numerics``:
round to nearest even (``e2m1_rne_bits``; ``e2m1_rne_mad`` adds the code into a packed word)
and stochastic rounding (``e2m1_sr_bits``). Codes are int32 with the sign in bit 3."""

from __future__ import annotations

import triton
import triton.language as tl

from hybrid_dist.kernels._jit_common import INTERPRET


@triton.jit
def e2m1_rne_ops(v):
    """E2M1 code (int32, sign in bit 3) of fp32 ``v``, magnitude clamped to 6, ties to even:
    bitwise ``_numerics.e2m1_encode(v)`` (NaN aside) in ~12 integer/float ops instead of a
    compare chain. ``u >= 1``: round the fp32 bits to one mantissa bit (code = biased
    exponent·2 + mantissa bit − 252); ``u < 1``: ``RNE(2u)`` by adding ``2**23``."""
    u = tl.minimum(tl.abs(v), 6.0)
    b = u.to(tl.int32, bitcast=True)
    hi = (b + (0x1FFFFF - (252 << 22)) + ((b >> 22) & 1)) >> 22
    lo = (u * 2.0 + 8388608.0).to(tl.int32, bitcast=True) & 3
    code = tl.where(u < 1.0, lo, hi)
    return tl.where(v < 0, code | 8, code)


@triton.jit
def e2m1_rne_bits(v):
    """``e2m1_rne_ops`` as one PTX block on the GPU (the same operations; the interpreter runs
    the ops). Opaque to LLVM, which otherwise splits the sign select off the code and
    reassociates it into the packing ORs: every code's magnitude then stays live until the
    signs are merged (157 instead of 240 registers for one direction at 8 elements per
    thread)."""
    if INTERPRET:
        return e2m1_rne_ops(v)
    return tl.inline_asm_elementwise(
        "{ .reg .f32 u, l; .reg .b32 b, t, h; .reg .pred p, q; "
        "abs.f32 u, $1; min.f32 u, u, 0f40C00000; mov.b32 b, u; "  # u = min(|v|, 6)
        "shr.u32 t, b, 22; and.b32 t, t, 1; add.s32 h, b, -1054867457; add.s32 h, h, t; "  # 0x1FFFFF - (252 << 22)
        "shr.s32 h, h, 22; fma.rn.f32 l, u, 0f40000000, 0f4B000000; mov.b32 t, l; and.b32 t, t, 3; "
        "setp.lt.f32 p, u, 0f3F800000; selp.b32 h, t, h, p; "
        "setp.lt.f32 q, $1, 0f00000000; @q or.b32 h, h, 8; mov.b32 $0, h; }",
        "=r,f", [v], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def e2m1_rne_mad(v, acc, mult):
    """``acc + e2m1_rne_bits(v) * mult`` (int32; codes land in disjoint nibbles, so the add is
    the packing OR): the packing and the sign are integer multiply-adds (FMA pipe) instead of
    logic ops (ALU pipe, half rate on sm_90, the kernel's bottleneck)."""
    if INTERPRET:
        return acc + e2m1_rne_bits(v) * mult
    return tl.inline_asm_elementwise(
        "{ .reg .f32 u, l; .reg .b32 b, t, h; .reg .pred p, q; "
        "abs.f32 u, $1; min.f32 u, u, 0f40C00000; mov.b32 b, u; "
        "shr.u32 t, b, 22; and.b32 t, t, 1; add.s32 h, b, -1054867457; add.s32 h, h, t; "
        "shr.s32 h, h, 22; fma.rn.f32 l, u, 0f40000000, 0f4B000000; mov.b32 t, l; and.b32 t, t, 3; "
        "setp.lt.f32 p, u, 0f3F800000; selp.b32 h, t, h, p; "
        "setp.lt.f32 q, $1, 0f00000000; @q add.s32 h, h, 8; mad.lo.u32 $0, h, $3, $2; }",
        "=r,f,r,r", [v, acc, mult], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def e2m1_sr_bits(v, rand):
    """Stochastic E2M1 code: up with probability ``(u - lo) / (hi - lo)``, bitwise
    ``_jit_common.e2m1_stochastic`` (the gap ``hi - lo`` is a power of two, so the IEEE
    division equals the multiplication by its exact inverse)."""
    u = tl.minimum(tl.abs(v), 6.0)
    b = u.to(tl.int32, bitcast=True)
    small = u < 1.0
    lo = tl.where(small, (u >= 0.5).to(tl.int32), tl.minimum((b >> 22) - 252, 6))
    e = (lo + 252) >> 1  # biased exponent of the grid value of code lo >= 2
    lo_val = tl.where(small, lo.to(tl.float32) * 0.5, ((lo + 252) << 22).to(tl.float32, bitcast=True))
    inv_gap = tl.where(small, 2.0, ((255 - e) << 23).to(tl.float32, bitcast=True))
    code = lo + (rand < (u - lo_val) * inv_gap).to(tl.int32)
    return tl.where(v < 0, code | 8, code)
