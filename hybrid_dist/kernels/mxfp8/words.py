"""MXFP8 quantize with both directions (or columnwise only) on bf16 pairs: the input read as
int32 words, eight interleaved row sets per program, and fp8 bytes packed four or eight at
a time. Outputs as ``formats.mxfp8``: ``data [M, K]`` + E8M0 ``[M, K/32]`` rowwise,
``data [K, M]`` + ``[K, M/32]`` columnwise.

[Note: MXFP8 words] A program owns ``x[BM, BK]`` (``BM = 32·G`` rows: ``G`` columnwise
blocks) and loads it as 8 row sets ``w_j [R = BM/8, W = BK/2]`` of int32 words: row ``r``
of set ``j`` is ``x`` row ``32·(r // 4) + 8·(r % 4) + j`` of the tile, word ``c`` holds
``x[., 2c]`` (low half) and ``x[., 2c+1]`` (high half). With ``W = 32`` (``BK = 64``) a thread
holds 4 words of 8 rows, i.e. 8 rows × 8 columns of one columnwise block, so:

* columnwise amax: an unsigned 16×2 max of ``w_j & 0x7FFF7FFF`` over the 8 sets inside the
  thread (``max.u16x2``; for non-negative bf16 the integer order is the float order), then
  over the 4 threads along M (two shuffles); rowwise amax likewise over the 4 threads that
  share a 1×32 block;
* each element is unpacked once (one shift or AND) and multiplied by both scales; pairs are
  cast with ``cvt.rn.satfinite.e4m3x2.f32`` (``e5m2x2``), as Triton's own fp8 cast;
* stores are 8 bytes: one int64 of rowwise bytes per set, one of columnwise bytes per column.

E8M0 scales come from the bf16 amax bits with integer ops (``_jit_common.e8m0_rceil_bf16``)
and go to staging buffers in which each program's bytes are contiguous (rowwise
``[K/BK, M, BK/32]``, columnwise ``[M/BM, K, BM/32]``), moved into place by
``scale_staging.unstage`` (written in place, each 32-byte sector of a scale tensor would take
its bytes from 8 to 16 programs). Programs run ``pid_k`` fastest, so those in flight read
whole rows. Bitwise ``formats.mxfp8.mxfp8_quantize_rows`` in each direction.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybrid_dist.kernels._jit_common import INTERPRET, cast_fp8, e8m0_inv_bf16, e8m0_rceil_bf16
from hybrid_dist.kernels._words import load8w, st8, st64, umax16x2, unpack
from hybrid_dist.kernels.scale_staging import staged


@triton.jit
def _byte(v, E5M2: tl.constexpr):
    """The fp8 byte of ``v`` (int32; interpreter path)."""
    if E5M2:
        return cast_fp8(v, 57344.0, tl.float8e5).to(tl.uint8, bitcast=True).to(tl.int32)
    return cast_fp8(v, 448.0, tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)


@triton.jit
def fp8x4(a, b, c, d, E5M2: tl.constexpr):
    """int32 of the saturating RNE fp8 bytes of fp32 ``a, b, c, d`` (``a`` in the low byte)."""
    if INTERPRET:
        return _byte(a, E5M2) | (_byte(b, E5M2) << 8) | (_byte(c, E5M2) << 16) | (_byte(d, E5M2) << 24)
    if E5M2:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 p, q; cvt.rn.satfinite.e5m2x2.f32 p, $2, $1; cvt.rn.satfinite.e5m2x2.f32 q, $4, $3; "
            "mov.b32 $0, {p, q}; }", "=r,f,f,f,f", [a, b, c, d], dtype=tl.int32, is_pure=True, pack=1)
    return tl.inline_asm_elementwise(
        "{ .reg .b16 p, q; cvt.rn.satfinite.e4m3x2.f32 p, $2, $1; cvt.rn.satfinite.e4m3x2.f32 q, $4, $3; "
        "mov.b32 $0, {p, q}; }", "=r,f,f,f,f", [a, b, c, d], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def join64(lo, hi):
    """int64 with int32 ``lo`` in the low and ``hi`` in the high word."""
    if INTERPRET:
        return (hi.to(tl.int64) << 32) | (lo.to(tl.int64) & 0xFFFFFFFF)
    return tl.inline_asm_elementwise("mov.b64 $0, {$1, $2};", "=l,r,r", [lo, hi], dtype=tl.int64,
                                     is_pure=True, pack=1)


@triton.jit
def _e8m0_bits(bits, E5M2: tl.constexpr):
    """(E8M0 code, fp32 ``2**(127-e)``) of an amax given as its fp32 bits (a bf16 value)."""
    e = e8m0_rceil_bf16(bits.to(tl.float32, bitcast=True), E5M2)
    return e, e8m0_inv_bf16(e)


@triton.jit
def _by_block(v, s, R: tl.constexpr, W: tl.constexpr):
    """``v [R, W]`` times ``s [R, W/16]`` (one per 16 words = one 1×32 block)."""
    return tl.reshape(tl.reshape(v, (R, W // 16, 16)) * s[:, :, None], (R, W))


@triton.jit
def _set(w, row, pid_k, cinv_lo, cinv_hi, row_ptr, row_s_ptr, M, K, E5M2: tl.constexpr,
         R: tl.constexpr, W: tl.constexpr, ROW: tl.constexpr, EVEN: tl.constexpr, UR: tl.constexpr):
    """Set ``w [R, W]`` (rows ``row [R, 1]``): rowwise bytes and scales stored; returns the
    columnwise products ``(x[., 2c] · cinv_lo, x[., 2c+1] · cinv_hi)``."""
    lo, hi = unpack(w)
    if ROW:
        am = tl.reduce(tl.reshape(w & 0x7FFF7FFF, (R, W // 16, 16)), 2, umax16x2)  # [R, W/16]
        e, inv = _e8m0_bits(tl.maximum(am << 16, am & -65536), E5M2)
        a_e, a_o = tl.split(tl.reshape(_by_block(lo, inv, R, W), (R, W // 2, 2)))
        b_e, b_o = tl.split(tl.reshape(_by_block(hi, inv, R, W), (R, W // 2, 2)))
        q = fp8x4(a_e, b_e, a_o, b_o, E5M2)  # [R, W/2]: bytes 4c' .. 4c'+3 of the tile's row
        q_e, q_o = tl.split(tl.reshape(q, (R, W // 4, 2)))
        q64 = join64(q_e, q_o)  # [R, W/4]
        pw = pid_k * (W // 4) + tl.arange(0, W // 4)[None, :]
        sc = pid_k * (W // 16) + tl.arange(0, W // 16)[None, :]
        ps = staged(row_s_ptr, row, sc, M, UR)
        if EVEN:
            tl.store(row_ptr + row * (K // 8) + pw, q64)
            st8(ps, e, tl.full(sc.shape, 1, tl.int1))
        else:
            tl.store(row_ptr + row * (K // 8) + pw, q64, mask=(row < M) & (pw < K // 8))
            st8(ps, e, (row < M) & (sc < K // 32))
    return lo * cinv_lo, hi * cinv_hi


@triton.jit
def mxfp8_words_kernel(
    x_ptr, row_ptr, row_s_ptr, col_ptr, col_s_ptr, M, K, stride_w,
    E5M2: tl.constexpr, ROW: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr,
    UR: tl.constexpr, UC: tl.constexpr,
):
    """One ``[BM, BK]`` tile (module note) → rowwise ``data [M, K]`` (``row_ptr``: its int64
    view ``[M, K/8]``) + ``scale [M, K/32]`` and columnwise ``data [K, M]`` (``col_ptr``: int64
    ``[K, M/8]``) + ``scale [K, M/32]``. ``x_ptr``: the bf16 input as int32 words ``[M, K/2]``
    (row stride ``stride_w``). Needs ``M % 32 == 0``, ``K % 32 == 0`` (``K`` even without ROW);
    ``EVEN``: ``M % BM == 0`` and ``K % BK == 0`` (no masks)."""
    pid_k, pid_m = tl.program_id(0), tl.program_id(1)  # K fastest: the programs in flight read whole rows
    R: tl.constexpr = BM // 8
    W: tl.constexpr = BK // 2
    r = tl.arange(0, R)[:, None]
    row = pid_m * BM + (r // 4) * 32 + (r % 4) * 8  # [R, 1]: rows of set 0
    cw = pid_k * W + tl.arange(0, W)[None, :]
    p = x_ptr + row * stride_w + cw
    if EVEN:
        okw = tl.full((1, W), 1, tl.int1)
        w0, w1, w2, w3 = tl.load(p), tl.load(p + stride_w), tl.load(p + 2 * stride_w), tl.load(p + 3 * stride_w)
        w4, w5 = tl.load(p + 4 * stride_w), tl.load(p + 5 * stride_w)
        w6, w7 = tl.load(p + 6 * stride_w), tl.load(p + 7 * stride_w)
    else:
        okw = cw < K // 2
        w0, w1, w2, w3, w4, w5, w6, w7 = load8w(p, row, okw, M, stride_w)
    m = 0x7FFF7FFF
    cm = umax16x2(umax16x2(umax16x2(w0 & m, w1 & m), umax16x2(w2 & m, w3 & m)),
                  umax16x2(umax16x2(w4 & m, w5 & m), umax16x2(w6 & m, w7 & m)))
    cm = tl.reduce(tl.reshape(cm, (R // 4, 4, W)), 1, umax16x2)  # [G, W]
    cm = tl.reshape(tl.broadcast_to(cm[:, None, :], (R // 4, 4, W)), (R, W))
    ce_lo, cinv_lo = _e8m0_bits(cm << 16, E5M2)
    ce_hi, cinv_hi = _e8m0_bits(cm & -65536, E5M2)
    a0, b0 = _set(w0, row, pid_k, cinv_lo, cinv_hi, row_ptr, row_s_ptr, M, K, E5M2, R, W, ROW, EVEN, UR)
    a1, b1 = _set(w1, row + 1, pid_k, cinv_lo, cinv_hi, row_ptr, row_s_ptr, M, K, E5M2, R, W, ROW, EVEN, UR)
    a2, b2 = _set(w2, row + 2, pid_k, cinv_lo, cinv_hi, row_ptr, row_s_ptr, M, K, E5M2, R, W, ROW, EVEN, UR)
    a3, b3 = _set(w3, row + 3, pid_k, cinv_lo, cinv_hi, row_ptr, row_s_ptr, M, K, E5M2, R, W, ROW, EVEN, UR)
    qa = fp8x4(a0, a1, a2, a3, E5M2)  # [R, W]: rows 0..3 of column 2c
    qb = fp8x4(b0, b1, b2, b3, E5M2)  # column 2c + 1
    a4, b4 = _set(w4, row + 4, pid_k, cinv_lo, cinv_hi, row_ptr, row_s_ptr, M, K, E5M2, R, W, ROW, EVEN, UR)
    a5, b5 = _set(w5, row + 5, pid_k, cinv_lo, cinv_hi, row_ptr, row_s_ptr, M, K, E5M2, R, W, ROW, EVEN, UR)
    a6, b6 = _set(w6, row + 6, pid_k, cinv_lo, cinv_hi, row_ptr, row_s_ptr, M, K, E5M2, R, W, ROW, EVEN, UR)
    a7, b7 = _set(w7, row + 7, pid_k, cinv_lo, cinv_hi, row_ptr, row_s_ptr, M, K, E5M2, R, W, ROW, EVEN, UR)
    col_a = join64(qa, fp8x4(a4, a5, a6, a7, E5M2))
    col_b = join64(qb, fp8x4(b4, b5, b6, b7, E5M2))
    ok = okw if EVEN else (row < M) & okw
    k = 2 * cw
    st64(col_ptr + k * (M // 8) + row // 8, col_a, ok)
    st64(col_ptr + (k + 1) * (M // 8) + row // 8, col_b, ok)
    first = (r % 4) == 0  # one thread row per block stores its scales
    blk = pid_m * (BM // 32) + r // 4
    st8(staged(col_s_ptr, k, blk, K, UC), ce_lo, ok & first)
    st8(staged(col_s_ptr, k + 1, blk, K, UC), ce_hi, ok & first)

