"""Warp-shuffle helpers over lane quads, for tensors ``[R, 32]`` laid out one element per
thread with element ``(r, c)`` on lane ``c`` (of the warp that holds row ``r``).

The caller guarantees that layout (``nvfp4.words`` uses these only at tile configs where the
per-row-set words are ``[num_warps, 64]``, two per thread, so ``[R, 32]`` is one per lane; the
GPU tests check every such config bitwise). A quad is the lanes ``4i .. 4i+3``; these are
the ``c`` of one 8-word (16-element) row block of ``nvfp4.words``, so a quad can share the
block-scale work of four row sets: lane ``c % 4`` computes set ``c % 4``'s scale once instead
of all four lanes computing all four (``quad_amax`` then ``quad_gather``).

The interpreter (``TRITON_INTERPRET=1``) runs the same semantics with reshapes and selects.
The asm is marked impure: shuffles must not be moved, merged or sunk into a branch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybrid_dist.kernels._jit_common import INTERPRET

# Reduce-scatter of four values over a quad in two butterfly rounds. $1 = c (lane); a lane
# with bit 1 set keeps sets 2, 3 and sends 0, 1 to lane ^ 2, the other way round otherwise;
# then bit 0 picks one of the two kept sets the same way with lane ^ 1. max.f32 drops NaN
# like tl.max / tl.maximum.
_QUAD_MAX_ASM = tl.constexpr(
    "{ .reg .pred h1, h0; .reg .b32 t; .reg .f32 s0, s1, k0, k1, r0, r1, a0, a1, s, k, r; "
    "and.b32 t, $1, 2; setp.ne.b32 h1, t, 0; and.b32 t, $1, 1; setp.ne.b32 h0, t, 0; "
    "selp.f32 s0, $2, $4, h1; selp.f32 s1, $3, $5, h1; selp.f32 k0, $4, $2, h1; selp.f32 k1, $5, $3, h1; "
    "shfl.sync.bfly.b32 r0, s0, 2, 31, -1; shfl.sync.bfly.b32 r1, s1, 2, 31, -1; "
    "max.f32 a0, k0, r0; max.f32 a1, k1, r1; "
    "selp.f32 s, a0, a1, h0; selp.f32 k, a1, a0, h0; "
    "shfl.sync.bfly.b32 r, s, 1, 31, -1; max.f32 $0, k, r; }")
# All-gather over a quad: lane k of the caller's quad (width-4 segments: c = 0x1c1f).
_QUAD_GATHER_ASM = tl.constexpr(
    "shfl.sync.idx.b32 $0, $4, 0, 7199, -1; shfl.sync.idx.b32 $1, $4, 1, 7199, -1; "
    "shfl.sync.idx.b32 $2, $4, 2, 7199, -1; shfl.sync.idx.b32 $3, $4, 3, 7199, -1;")


@triton.jit
def _quad_pick(v, k: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    """``[R, C]``: element ``(r, c)`` = ``v[r, (c & ~3) | k]`` (interpreter path; a masked sum:
    exact for the non-negative encode multipliers it gathers, a ``-0.0`` would read ``+0.0``)."""
    v3 = tl.reshape(v, (R, C // 4, 4))
    pick = tl.sum(tl.where(tl.arange(0, 4)[None, None, :] == k, v3, 0.0), axis=2)
    return tl.reshape(tl.broadcast_to(pick[:, :, None], (R, C // 4, 4)), (R, C))


@triton.jit
def _quad_max(v, R: tl.constexpr, C: tl.constexpr):
    """``[R, C]``: element ``(r, c)`` = the max of ``v`` over ``c``'s quad (interpreter path)."""
    m = tl.max(tl.reshape(v, (R, C // 4, 4)), axis=2)
    return tl.reshape(tl.broadcast_to(m[:, :, None], (R, C // 4, 4)), (R, C))


@triton.jit
def quad_amax(p0, p1, p2, p3, c, R: tl.constexpr, C: tl.constexpr):
    """fp32 ``[R, C]``: element ``(r, c)`` = the max over ``c``'s quad of ``p{c % 4}`` (each
    ``p`` fp32 ``[R, C]``; ``c`` the int32 column index ``[1, C]``)."""
    if INTERPRET:
        q = c % 4
        return tl.where(q == 0, _quad_max(p0, R, C), tl.where(q == 1, _quad_max(p1, R, C), tl.where(
            q == 2, _quad_max(p2, R, C), _quad_max(p3, R, C))))
    return tl.inline_asm_elementwise(_QUAD_MAX_ASM, "=f,r,f,f,f,f", [tl.broadcast_to(c, (R, C)), p0, p1, p2, p3],
                                     dtype=tl.float32, is_pure=False, pack=1)


@triton.jit
def quad_gather(v, R: tl.constexpr, C: tl.constexpr):
    """``(g0, g1, g2, g3)``, fp32 ``[R, C]`` each: ``g{k}[r, c] = v[r, (c & ~3) | k]``."""
    if INTERPRET:
        return _quad_pick(v, 0, R, C), _quad_pick(v, 1, R, C), _quad_pick(v, 2, R, C), _quad_pick(v, 3, R, C)
    return tl.inline_asm_elementwise(_QUAD_GATHER_ASM, "=f,=f,=f,=f,f", [v],
                                     dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=False, pack=1)
