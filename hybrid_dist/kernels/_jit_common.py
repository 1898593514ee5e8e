"""Bit-exact Triton building blocks shared by the quantize and dequantize kernels.

Each helper mirrors one function of ``hybrid_dist.formats.numerics`` (same IEEE
operations in the same order), so the kernels reproduce the reference bitwise:

* every fp32 division is ``tl.math.div_rn`` (Triton's ``/`` is approximate);
* fp32 -> fp8 casts saturate and round to nearest even (``cvt.rn.satfinite`` on sm_90; the
  interpreter clamps first);
* powers of two are built from bits (``exp2_int``), never with ``exp2``;
* fp32 -> bf16 roundings are done on the bits (``round_bf16``): the same RNE as the
  GPU's ``cvt.rn.bf16.f32``, and exact under the Triton interpreter too (whose cast
  truncates).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

FP32_MAX = tl.constexpr(3.4028234663852886e38)
INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")  # read once, when kernels are defined


@triton.jit
def div_rn(a, b):
    """IEEE round-to-nearest fp32 division (``torch`` semantics)."""
    return tl.math.div_rn(a, b)


@triton.jit
def cast_fp8(v, fmax: tl.constexpr, out_dtype: tl.constexpr):
    """Saturating RNE cast of fp32 ``v`` (``numerics.cast_to_fp8``: clamp to ``±fmax``, then cast).

    On the GPU the cast alone is that function: Triton lowers it to ``cvt.rn.satfinite``
    (``F2FP.SATFINITE.E4M3`` / ``.E5M2`` in the sm_90 SASS), which saturates finite values and
    ±inf to ±fmax and keeps NaN a NaN, as ``clamp`` then ``.to`` does in torch. The explicit
    clamp cost two min/max per element and direction (4 of 25 SASS instructions per element
    in the two-direction MXFP8 kernel), and it turned NaN into ``-fmax`` (Triton's
    ``maximum`` returns the non-NaN operand). The interpreter's cast does not saturate, so
    the clamp stays there (NaN aside, the same bytes)."""
    if INTERPRET:
        v = tl.minimum(tl.maximum(v, -fmax), fmax)
    return v.to(out_dtype, fp_downcast_rounding="rtne")


@triton.jit
def round_bf16(v):
    """fp32 ``v`` rounded to the nearest bf16 (ties to even), returned as fp32; NaN stays NaN."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & -65536  # -65536 == 0xFFFF0000
    return tl.where(v != v, v, bits.to(tl.float32, bitcast=True))


@triton.jit
def exp2_int(k):
    """Exact ``2.0**k`` (fp32) for int32 ``k`` in [-149, 127] (``numerics.exp2_int``)."""
    normal = tl.maximum(k + 127, 1) << 23
    subnormal = tl.full(k.shape, 1, tl.int32) << tl.minimum(tl.maximum(k + 149, 0), 22)
    bits = tl.where(k >= -126, normal, subnormal)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def pow2_floor(x):
    """Largest power of two <= positive normal fp32 ``x`` (``numerics.pow2_floor``)."""
    return (x.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)


@triton.jit
def e8m0_rceil(amax, E5M2: tl.constexpr):
    """Biased E8M0 exponent (int32) of ``RCEIL(RN(amax / fmax))`` for ``fmax = 1.75 · 2**SHIFT``
    (E4M3 448: 8, E5M2 57344: 15), with integer ops only: bitwise ``numerics.e8m0_from_amax`` for
    every non-negative fp32 ``amax`` (checked over all 2**31 bit patterns, NaN/Inf → 255).

    ``RN(a/fmax) <= 2**p`` iff ``a <= fmax · 2**p · (1 + 2**-24)`` (ties go to the even
    ``2**p``), i.e. iff the mantissa of ``a`` is ``<= 1.75`` at exponent ``p + SHIFT``; at the
    subnormal boundary ``2**-127`` the half-ulp is ``2**-150``, one ulp of ``a`` more."""
    SHIFT = 15 if E5M2 else 8
    bits = amax.to(tl.int32, bitcast=True)
    ea = (bits >> 23) & 0xFF
    thr = 0x600000 + (ea == SHIFT).to(tl.int32)
    e = tl.maximum(ea - SHIFT + ((bits & 0x7FFFFF) > thr).to(tl.int32), 0)
    return tl.where(ea == 0xFF, 0xFF, e)


@triton.jit
def e8m0_rceil_bf16(amax, E5M2: tl.constexpr):
    """``e8m0_rceil`` for an ``amax`` that is a bf16 value (a max of ``|bf16|``; its low 16 bits
    are zero): the mantissa then carries into the exponent under ``+ 0x1FFFFF`` iff it is above
    1.5 (``> 0x600000``), with no subnormal special case. 5 integer ops instead of ~10;
    bitwise ``e8m0_rceil`` for every non-negative bf16 (interpreter test: all 2**15)."""
    SHIFT: tl.constexpr = 15 if E5M2 else 8
    bits = amax.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits + 0x1FFFFF) >> 23) - SHIFT, 0)
    return tl.where(bits >= 0x7F800000, 0xFF, e)


@triton.jit
def e8m0_inv_bf16(e):
    """``exp2_int(127 - e)`` (fp32) for the codes of ``e8m0_rceil_bf16``: at most 247 (E4M3;
    240 for E5M2) for finite amax, so ``2**(127-e)`` is normal (bits ``(254-e) << 23``), or
    255 (inf/NaN amax: ``2**-128``)."""
    return tl.where(e == 255, 0x00200000, 0x7F000000 - (e << 23)).to(tl.float32, bitcast=True)


@triton.jit
def per_block_scale(amax, fmax: tl.constexpr, eps: tl.constexpr, POW2: tl.constexpr):
    """FP8 encode scale ``fmax / max(amax, eps)`` (1 when 0), clamped, optional pow2 floor."""
    amax = tl.maximum(amax, eps)
    scale = tl.where(amax > 0, div_rn(tl.zeros_like(amax) + fmax, amax), 1.0)
    scale = tl.minimum(scale, FP32_MAX)
    if POW2:
        scale = pow2_floor(scale)
    return scale


@triton.jit
def global_decode_scale(amax):
    """NVFP4 per-tensor decode scale ``1 / min(448·6 / amax, fp32 max)`` (1 when amax is 0 or
    NaN): ``formats.nvfp4.nvfp4_global_scale``, the same IEEE operations."""
    scale = per_block_scale(amax, 2688.0, 0.0, False)
    return div_rn(tl.zeros_like(scale) + 1.0, scale)


@triton.jit
def _e2m1_grid(idx):
    """E2M1 magnitude of a 3-bit code (0, .5, 1, 1.5, 2, 3, 4, 6)."""
    half = idx.to(tl.float32) * 0.5
    return tl.where(idx <= 4, half, tl.where(idx == 5, 3.0, tl.where(idx == 6, 4.0, 6.0)))


@triton.jit
def e2m1_decode(code):
    """fp32 value of an E2M1 code (low 4 bits); code 8 is -0.0. The sign is set on the bits
    (the interpreter's negation of 0.0 gives +0.0)."""
    mag = _e2m1_grid(code & 7)
    return (mag.to(tl.int32, bitcast=True) | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def same_layout(v, ref):
    """``v`` (32-bit), placed in ``ref``'s register layout: a move that reads both, so the
    compiler's layout pass computes ``v`` where ``ref`` lives. Without it, values built from
    ``tl.arange`` alone take the default layout and long chains on them (Philox) end in one
    shared-memory layout conversion per use."""
    if INTERPRET:
        return v
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r", [v, ref], dtype=v.dtype, is_pure=True, pack=1)


@triton.jit
def store_tile(ptr, v, mask, EVEN: tl.constexpr):
    """``tl.store(ptr, v, mask=mask)``, without the mask when ``EVEN`` (the host launched
    whole tiles only: every address in range)."""
    if EVEN:
        tl.store(ptr, v)
    else:
        tl.store(ptr, v, mask=mask)


@triton.jit
def pack_pairs(codes, R: tl.constexpr, C: tl.constexpr):
    """Pack int32 codes ``[R, C]`` into uint8 ``[R, C/2]`` (element 2j low nibble)."""
    lo, hi = tl.split(tl.reshape(codes, (R, C // 2, 2)))
    return (lo | (hi << 4)).to(tl.uint8)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host ints (``triton.cdiv`` is a slower JIT-callable on the host)."""
    return -(-a // b)


def eager_or_op(op, raw):
    """Call the raw host wrapper in eager mode (skips the dispatcher's per-call cost) and
    the registered ``torch.library`` op while ``torch.compile`` traces."""

    def call(*args):
        if torch.compiler.is_compiling():
            return op(*args)
        return raw(*args)

    call.__name__ = getattr(raw, "__name__", "op")
    call.__doc__ = raw.__doc__
    return call


RCP6_BITS = tl.constexpr(0x3E2AAAAB)  # RN(1/6) in fp32


@triton.jit
def div_by_rcp(a, y, r):
    """``RN(a / y)`` from ``r = RN(1 / y)`` in three fp32 ops instead of an IEEE division
    (~9 SASS instructions and a slow-path branch): ``q = RN(a·r)`` is within one ulp of
    ``a/y``, the FMA gives the exact remainder ``a - q·y``, and ``RN(q + rem·r)`` is then
    ``RN(a/y)`` (Markstein's correction theorem) as long as that remainder is not below
    the fp32 subnormal quantum, i.e. for ``|a| >= 2**-100`` or so. The interpreter's
    ``fma`` rounds twice, so it divides."""
    if INTERPRET:
        return div_rn(a, y)
    q = a * r
    return tl.fma(tl.fma(-q, y, a), r, q)


@triton.jit
def rcp_fast(d):
    """``RN(1 / d)`` for ``d`` in ``[2**-126, 2**126)`` (NaN stays NaN): the fast path of
    ``rcp.rn.f32`` alone, ``r = rcp.approx(d)`` then ``r + r·(1 - d·r)`` (two FMAs; the same
    instructions the compiler emits for ``rcp.rn`` on that range, without its range test,
    branch and slow-path call: ~10 SASS instructions → 4). Outside the range the result is
    not IEEE (``ftz``)."""
    if INTERPRET:
        return div_rn(tl.zeros_like(d) + 1.0, d)
    return tl.inline_asm_elementwise(
        "{ .reg .f32 r, e; rcp.approx.ftz.f32 r, $1; fma.rn.f32 e, $1, r, 0fBF800000; neg.f32 e, e; "
        "fma.rn.f32 $0, r, e, r; }", "=f,f", [d], dtype=tl.float32, is_pure=True, pack=1)


TINY_GS = tl.constexpr(2.0**-91)  # below: a tensor amax under ~2**-80, outside div_by_rcp's exact domain


@triton.jit
def nvfp4_block_scale(bamax, gs):
    """NVFP4 block scale: E4M3 ``sat(amax_block / 6 / gs)`` and the fp32 encode multiplier
    ``min(1/(bs·gs), fp32 max)`` (0 if ``bs·gs`` is 0), as ``formats.nvfp4.nvfp4_quantize_rows``,
    for a scalar ``gs``.

    For ``gs >= 2**-91`` (a tensor amax of at least ``2**-80``) the two quotients are
    ``div_by_rcp`` with ``RN(1/6)`` and ``RN(1/gs)`` (one division per program: the compiler
    shares it between the inlined calls), bitwise the reference's IEEE divisions there: a
    block whose ``amax/6`` is under ``2**-100`` (where the remainder could underflow) then
    has ``amax/6/gs < 2**-10.6`` and an E4M3 scale of 0 either way. ``gs = inf`` (an inf
    amax) divides as ``min(gs, fp32 max)``: ``a/inf = 0`` for finite ``a``, NaN for ``inf``,
    as IEEE. The encode multiplier is ``rcp_fast(bs·gs)``: on that domain ``gs`` lies in
    ``[2**-91, 2**116.6]`` and a nonzero E4M3 ``bs`` in ``[2**-9, 448]``, so ``bs·gs`` is 0,
    NaN (masked to 0 below) or within ``[2**-100, 2**125.4]``, inside its exact range, and
    the clamp at the fp32 max could not change it, so it is left out.

    A smaller ``gs`` (a tiny tensor; ``gs`` bottoms out at ``2**-128``, where ``RN(1/gs)``
    is inf) takes IEEE divisions instead, one uniform branch per call: ``bs·gs`` may then be
    subnormal and its reciprocal above the fp32 max, which is clamped there, as
    TransformerEngine does (``fminf(1/(S_dec_b · S_dec), FLT_MAX)``). Why ``rcp_fast``:
    ``docs/design.md`` §8."""
    if gs >= TINY_GS:
        r6 = tl.full([], RCP6_BITS, tl.int32).to(tl.float32, bitcast=True)
        rcp_gs = div_rn(1.0, gs)
        bs = cast_fp8(div_by_rcp(div_by_rcp(bamax, 6.0, r6), tl.minimum(gs, FP32_MAX), rcp_gs), 448.0,
                      tl.float8e4nv)
        denom = bs.to(tl.float32) * gs
        enc = tl.where(denom > 0, rcp_fast(denom), 0.0)
    else:
        bs = cast_fp8(div_rn(div_rn(bamax, tl.zeros_like(bamax) + 6.0), gs), 448.0, tl.float8e4nv)
        denom = bs.to(tl.float32) * gs
        enc = tl.where(denom > 0, tl.minimum(div_rn(tl.zeros_like(denom) + 1.0, denom), FP32_MAX), 0.0)
    return bs, enc
