"""NVFP4 Triton kernels: the fused quantize pass and the per-tensor amax pass.

[Note: 16 interleaved row sets] A program owns ``x[BM, BK]`` and loads it as 16 row sets
``x_j = x[m ≡ j (mod 16)]``, each ``[R = BM/16, BK]`` and all in one register layout. Row
``i`` of every set belongs to the same 16-row group ``m = 16i .. 16i+15`` (one columnwise
block), so everything columnwise is elementwise across the 16 sets:

* columnwise block amax (16 along M): ``max_j |x_j|`` — no cross-thread reduction;
* the RHT ``y = T x`` of each 16-group is a 16-point Walsh–Hadamard butterfly across the
  sets on ``u_j = x_j · T[0, j]`` (``T = H16 · diag(s) / 4``, so ``T[0, j] = s_j / 4``; the
  products are the reference's exact products, only the fp32 summation order differs);
* the 16 columnwise codes of a group are packed into one int64 (codes of sets 0..7 in the
  low word, code ``j`` at bits ``4j``) **before** the transpose: the ``[K, M/2]`` store
  writes ``[BK, R]`` int64 (8 bytes = 16 consecutive m of one stored row).

Rowwise blocks (1×16, or 16×16 for 2D) reduce along K inside each set. 2D without RHT
derives columnwise from the rowwise codes (exact transpose, as the reference).
Stochastic rounding: 8 random bits per element (``_e2m1.e2m1_sr_mad``). One Philox call
(``tl.randint4x``, 4 int32 words) serves the 16 elements of a 16-row group at one column:
element ``(m, k)`` takes byte ``m % 4`` of word ``(m % 16) / 4`` of counter ``(m / 16)·K + k``
(rowwise), ``⌈M/16⌉·K + (m / 16)·K + k`` (columnwise), i.e. set ``j`` takes byte ``j % 4`` of
word ``j / 4`` of the tile's ``[R, BK]`` counters. Counters are uint32 (the host checks that
they do not wrap).
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybrid_dist.kernels.nvfp4._e2m1 import e2m1_rne_bits, e2m1_rne_mad, e2m1_sr_mad, sr_noise
from hybrid_dist.kernels._jit_common import global_decode_scale, pack_pairs, same_layout, store_tile
from hybrid_dist.kernels._jit_common import nvfp4_block_scale as _block_scale


@triton.jit
def _ld(p, ok, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(p).to(tl.float32)
    else:
        return tl.load(p, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _load16(x_ptr, rs, rk, M, K, stride_m, EVEN: tl.constexpr):
    """The 16 row sets ``x[rs + j, rk]`` (fp32 ``[R, BK]``), zero outside ``[M, K]``
    (``EVEN``: the tile lies inside, no masks)."""
    p = x_ptr + rs * stride_m + rk
    mk = rk < K
    x0 = _ld(p, (rs < M) & mk, EVEN)
    x1 = _ld(p + stride_m, (rs + 1 < M) & mk, EVEN)
    x2 = _ld(p + 2 * stride_m, (rs + 2 < M) & mk, EVEN)
    x3 = _ld(p + 3 * stride_m, (rs + 3 < M) & mk, EVEN)
    x4 = _ld(p + 4 * stride_m, (rs + 4 < M) & mk, EVEN)
    x5 = _ld(p + 5 * stride_m, (rs + 5 < M) & mk, EVEN)
    x6 = _ld(p + 6 * stride_m, (rs + 6 < M) & mk, EVEN)
    x7 = _ld(p + 7 * stride_m, (rs + 7 < M) & mk, EVEN)
    x8 = _ld(p + 8 * stride_m, (rs + 8 < M) & mk, EVEN)
    x9 = _ld(p + 9 * stride_m, (rs + 9 < M) & mk, EVEN)
    x10 = _ld(p + 10 * stride_m, (rs + 10 < M) & mk, EVEN)
    x11 = _ld(p + 11 * stride_m, (rs + 11 < M) & mk, EVEN)
    x12 = _ld(p + 12 * stride_m, (rs + 12 < M) & mk, EVEN)
    x13 = _ld(p + 13 * stride_m, (rs + 13 < M) & mk, EVEN)
    x14 = _ld(p + 14 * stride_m, (rs + 14 < M) & mk, EVEN)
    x15 = _ld(p + 15 * stride_m, (rs + 15 < M) & mk, EVEN)
    return x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15


@triton.jit
def _rht16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, t_ptr):
    """``y_p = Σ_q T[p, q] x_q`` for the 16 sets: ``x_q · T[0, q]`` then the Sylvester
    butterflies (``H16[p, q] = (-1)^popcount(p & q)``). ``t_ptr``: fp32 ``T[0, :]``."""
    x0 *= tl.load(t_ptr)
    x1 *= tl.load(t_ptr + 1)
    x2 *= tl.load(t_ptr + 2)
    x3 *= tl.load(t_ptr + 3)
    x4 *= tl.load(t_ptr + 4)
    x5 *= tl.load(t_ptr + 5)
    x6 *= tl.load(t_ptr + 6)
    x7 *= tl.load(t_ptr + 7)
    x8 *= tl.load(t_ptr + 8)
    x9 *= tl.load(t_ptr + 9)
    x10 *= tl.load(t_ptr + 10)
    x11 *= tl.load(t_ptr + 11)
    x12 *= tl.load(t_ptr + 12)
    x13 *= tl.load(t_ptr + 13)
    x14 *= tl.load(t_ptr + 14)
    x15 *= tl.load(t_ptr + 15)
    x0, x1 = x0 + x1, x0 - x1
    x2, x3 = x2 + x3, x2 - x3
    x4, x5 = x4 + x5, x4 - x5
    x6, x7 = x6 + x7, x6 - x7
    x8, x9 = x8 + x9, x8 - x9
    x10, x11 = x10 + x11, x10 - x11
    x12, x13 = x12 + x13, x12 - x13
    x14, x15 = x14 + x15, x14 - x15
    x0, x2 = x0 + x2, x0 - x2
    x1, x3 = x1 + x3, x1 - x3
    x4, x6 = x4 + x6, x4 - x6
    x5, x7 = x5 + x7, x5 - x7
    x8, x10 = x8 + x10, x8 - x10
    x9, x11 = x9 + x11, x9 - x11
    x12, x14 = x12 + x14, x12 - x14
    x13, x15 = x13 + x15, x13 - x15
    x0, x4 = x0 + x4, x0 - x4
    x1, x5 = x1 + x5, x1 - x5
    x2, x6 = x2 + x6, x2 - x6
    x3, x7 = x3 + x7, x3 - x7
    x8, x12 = x8 + x12, x8 - x12
    x9, x13 = x9 + x13, x9 - x13
    x10, x14 = x10 + x14, x10 - x14
    x11, x15 = x11 + x15, x11 - x15
    x0, x8 = x0 + x8, x0 - x8
    x1, x9 = x1 + x9, x1 - x9
    x2, x10 = x2 + x10, x2 - x10
    x3, x11 = x3 + x11, x3 - x11
    x4, x12 = x4 + x12, x4 - x12
    x5, x13 = x5 + x13, x5 - x13
    x6, x14 = x6 + x14, x6 - x14
    x7, x15 = x7 + x15, x7 - x15
    return x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15


@triton.jit
def _kmax(v, R: tl.constexpr, BK: tl.constexpr, K16: tl.constexpr):
    """max|v| over each 16 consecutive k (``[R, BK/16]``) if ``K16``, else ``|v|``."""
    if K16:
        return tl.max(tl.reshape(tl.abs(v), (R, BK // 16, 16)), axis=2)
    else:
        return tl.abs(v)


@triton.jit
def _max16(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15):
    a0 = tl.maximum(tl.maximum(tl.maximum(a0, a1), tl.maximum(a2, a3)),
                    tl.maximum(tl.maximum(a4, a5), tl.maximum(a6, a7)))
    a8 = tl.maximum(tl.maximum(tl.maximum(a8, a9), tl.maximum(a10, a11)),
                    tl.maximum(tl.maximum(a12, a13), tl.maximum(a14, a15)))
    return tl.maximum(a0, a8)


@triton.jit
def _scaled(v, enc, R: tl.constexpr, BK: tl.constexpr, K16: tl.constexpr):
    """``v · enc`` (``enc [R, BK/16]`` per 16 k if ``K16``, else ``[R, BK]``)."""
    if K16:
        return tl.reshape(tl.reshape(v, (R, BK // 16, 16)) * enc[:, :, None], (R, BK))
    else:
        return v * enc


@triton.jit
def _codes_into(acc, j: tl.constexpr, v, enc, w, R: tl.constexpr, BK: tl.constexpr, K16: tl.constexpr,
                SR: tl.constexpr):
    """``acc`` plus the E2M1 codes of ``v · enc`` in nibble ``j`` (``acc`` zero: the codes);
    SR with the noise of byte ``j % 4`` of the random words ``w`` (int32 ``[R, BK]``)."""
    mult = tl.full((R, BK), 1 << (4 * j), tl.int32)
    if SR:
        return e2m1_sr_mad(_scaled(v, enc, R, BK, K16), sr_noise(w, j % 4), acc, mult)
    return e2m1_rne_mad(_scaled(v, enc, R, BK, K16), acc, mult)


@triton.jit
def _codes(v, enc, w, B: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, K16: tl.constexpr, SR: tl.constexpr):
    """E2M1 codes (int32 ``[R, BK]``) of ``v · enc``; SR with byte ``B`` of the words ``w``."""
    if SR:
        return e2m1_sr_mad(_scaled(v, enc, R, BK, K16), sr_noise(w, B), tl.zeros((R, BK), tl.int32),
                           tl.full((R, BK), 1, tl.int32))
    return e2m1_rne_bits(_scaled(v, enc, R, BK, K16))


@triton.jit
def _codes8(x0, x1, x2, x3, x4, x5, x6, x7, enc, w_a, w_b, R: tl.constexpr, BK: tl.constexpr,
            K16: tl.constexpr, SR: tl.constexpr):
    """Eight sets' codes packed into one int32 word (set ``i`` in nibble ``i``); SR noise of
    sets 0-3 from the random words ``w_a``, of sets 4-7 from ``w_b``."""
    w = tl.zeros((R, BK), tl.int32)
    w = _codes_into(w, 0, x0, enc, w_a, R, BK, K16, SR)
    w = _codes_into(w, 1, x1, enc, w_a, R, BK, K16, SR)
    w = _codes_into(w, 2, x2, enc, w_a, R, BK, K16, SR)
    w = _codes_into(w, 3, x3, enc, w_a, R, BK, K16, SR)
    w = _codes_into(w, 4, x4, enc, w_b, R, BK, K16, SR)
    w = _codes_into(w, 5, x5, enc, w_b, R, BK, K16, SR)
    w = _codes_into(w, 6, x6, enc, w_b, R, BK, K16, SR)
    return _codes_into(w, 7, x7, enc, w_b, R, BK, K16, SR)


@triton.jit
def _row_set(x, enc_2d, gs, w, B: tl.constexpr, rows, pid_k, row_ptr, M, K, R: tl.constexpr,
             BK: tl.constexpr, TWO_D: tl.constexpr, SR: tl.constexpr, STORE: tl.constexpr, EVEN: tl.constexpr):
    """Rowwise codes of one set and its 1×16 block scales ``[R, BK/16]`` (``enc_2d`` and
    no scales of its own for 16×16 blocks); with ``STORE`` writes the packed ``[R, BK/2]``
    bytes at ``rows`` (the scales of the 16 sets are stored together: ``_store_row_scales``)."""
    if TWO_D:
        bs = enc_2d
        codes = _codes(x, enc_2d, w, B, R, BK, True, SR)
    else:
        bs, enc = _block_scale(_kmax(x, R, BK, True), gs)
        codes = _codes(x, enc, w, B, R, BK, True, SR)
    if STORE:
        pk = pid_k * (BK // 2) + tl.arange(0, BK // 2)[None, :]
        store_tile(row_ptr + rows * (K // 2) + pk, pack_pairs(codes, R, BK), (rows < M) & (pk < K // 2), EVEN)
    return codes, bs


@triton.jit
def _store_row_scales4(s0, s1, s2, s3, j0: tl.constexpr, row_s_ptr, pid_m, pid_k, M, K,
                       R: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr):
    """The 1×16 scales of sets ``j0 .. j0+3`` (``s_j [R, BK/16]``: rows ``16i + j`` of the
    tile) in one store: one layout conversion per 4 sets instead of one per set (all 16 at
    once keeps too many scales live: 254 registers at 64×256)."""
    C: tl.constexpr = BK // 16
    s = tl.reshape(tl.join(tl.join(s0, s2), tl.join(s1, s3)), (R, C, 4))  # join appends its axis: [.., j//2, j%2]
    i = tl.arange(0, R)[:, None, None]
    rows = pid_m * (R * 16) + i * 16 + j0 + tl.arange(0, 4)[None, None, :]
    sk = pid_k * C + tl.arange(0, C)[None, :, None]
    store_tile(row_s_ptr + rows * (K // 16) + sk, s, (rows < M) & (sk < K // 16), EVEN)


@triton.jit
def _store_col(w_lo, w_hi, bs, col64_ptr, col_s_ptr, pid_m, pid_k, M, K, R: tl.constexpr,
               BK: tl.constexpr, K16: tl.constexpr, EVEN: tl.constexpr):
    """Columnwise store: words ``[R, BK]`` → ``data [K, M/2]`` (as int64 ``[K, M/16]``),
    block scales ``bs [R, BK/16 or BK]`` → ``[K/16 or K, M/16]`` (32-bit transposes);
    ``EVEN``: the tile lies inside ``x``, no masks."""
    w = (w_lo.to(tl.int64) & 0xFFFFFFFF) | (w_hi.to(tl.int64) << 32)
    ck = pid_k * BK + tl.arange(0, BK)[:, None]
    cw = pid_m * R + tl.arange(0, R)[None, :]
    if EVEN:  # written out: through store_tile the RHT + SR kernel compiles to another schedule
        tl.store(col64_ptr + ck * (M // 16) + cw, tl.trans(w))
    else:
        tl.store(col64_ptr + ck * (M // 16) + cw, tl.trans(w), mask=(ck < K) & (cw < M // 16))
    if K16:
        sk = pid_k * (BK // 16) + tl.arange(0, BK // 16)[:, None]
        nk = K // 16
    else:
        sk = ck
        nk = K
    bs_t = tl.trans(bs.to(tl.float32)).to(tl.float8e4nv)
    store_tile(col_s_ptr + sk * (M // 16) + cw, bs_t, (sk < nk) & (cw < M // 16), EVEN)


@triton.jit
def _rows4(x0, x1, x2, x3, j0: tl.constexpr, enc2, gs, w, rs, pid_m, pid_k, row_ptr, row_s_ptr,
           M, K, R: tl.constexpr, BK: tl.constexpr, TWO_D: tl.constexpr, SR: tl.constexpr, ROW: tl.constexpr,
           EVEN: tl.constexpr):
    """Sets ``j0 .. j0+3`` (``x0..x3``; SR noise from bytes 0..3 of the words ``w``) rowwise
    (stored if ``ROW``, 1×16 scales in one store); returns their codes packed
    ``c0 | c1 << 4 | c2 << 8 | c3 << 12`` (int32)."""
    c0, s0 = _row_set(x0, enc2, gs, w, 0, rs + j0, pid_k, row_ptr, M, K, R, BK, TWO_D, SR, ROW, EVEN)
    c1, s1 = _row_set(x1, enc2, gs, w, 1, rs + j0 + 1, pid_k, row_ptr, M, K, R, BK, TWO_D, SR, ROW, EVEN)
    c2, s2 = _row_set(x2, enc2, gs, w, 2, rs + j0 + 2, pid_k, row_ptr, M, K, R, BK, TWO_D, SR, ROW, EVEN)
    c3, s3 = _row_set(x3, enc2, gs, w, 3, rs + j0 + 3, pid_k, row_ptr, M, K, R, BK, TWO_D, SR, ROW, EVEN)
    if ROW and not TWO_D:
        _store_row_scales4(s0, s1, s2, s3, j0, row_s_ptr, pid_m, pid_k, M, K, R, BK, EVEN)
    return c0 | (c1 << 4) | (c2 << 8) | (c3 << 12)


@triton.jit
def _rows16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
            gs, w0, w1, w2, w3, rs, pid_m, pid_k, row_ptr, row_s_ptr, col64_ptr, col_s_ptr, M, K,
            R: tl.constexpr, BK: tl.constexpr, TWO_D: tl.constexpr, SR: tl.constexpr, ROW: tl.constexpr,
            DERIVE_COL: tl.constexpr, EVEN: tl.constexpr):
    """Rowwise codes of the 16 sets (stored if ``ROW``), global decode scale ``gs``; with
    ``DERIVE_COL`` (2D blocks) also their exact transpose as the columnwise direction; SR
    noise of set ``j`` from byte ``j % 4`` of the random words ``w{j / 4}``."""
    enc2 = gs  # unused by 1×16 blocks
    if TWO_D:  # 16×16 blocks: amax over the 16 sets of each set's 16-along-K max
        bs2, enc2 = _block_scale(_max16(
            _kmax(x0, R, BK, True), _kmax(x1, R, BK, True), _kmax(x2, R, BK, True),
            _kmax(x3, R, BK, True), _kmax(x4, R, BK, True), _kmax(x5, R, BK, True),
            _kmax(x6, R, BK, True), _kmax(x7, R, BK, True), _kmax(x8, R, BK, True),
            _kmax(x9, R, BK, True), _kmax(x10, R, BK, True), _kmax(x11, R, BK, True),
            _kmax(x12, R, BK, True), _kmax(x13, R, BK, True), _kmax(x14, R, BK, True),
            _kmax(x15, R, BK, True)), gs)
        if ROW:
            sb = pid_m * R + tl.arange(0, R)[:, None]
            sk = pid_k * (BK // 16) + tl.arange(0, BK // 16)[None, :]
            tl.store(row_s_ptr + sb * (K // 16) + sk, bs2, mask=(sb < M // 16) & (sk < K // 16))
    w_lo = _rows4(x0, x1, x2, x3, 0, enc2, gs, w0, rs, pid_m, pid_k, row_ptr, row_s_ptr,
                M, K, R, BK, TWO_D, SR, ROW, EVEN)
    w_lo |= _rows4(x4, x5, x6, x7, 4, enc2, gs, w1, rs, pid_m, pid_k, row_ptr, row_s_ptr,
                M, K, R, BK, TWO_D, SR, ROW, EVEN) << 16
    w_hi = _rows4(x8, x9, x10, x11, 8, enc2, gs, w2, rs, pid_m, pid_k, row_ptr, row_s_ptr,
                M, K, R, BK, TWO_D, SR, ROW, EVEN)
    w_hi |= _rows4(x12, x13, x14, x15, 12, enc2, gs, w3, rs, pid_m, pid_k, row_ptr, row_s_ptr,
                M, K, R, BK, TWO_D, SR, ROW, EVEN) << 16
    if DERIVE_COL:  # codes packed as they are made (``w |= code << 4j``: few live registers)
        _store_col(w_lo, w_hi, bs2, col64_ptr, col_s_ptr, pid_m, pid_k, M, K, R, BK, True, EVEN)


@triton.jit
def _cols16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
            t_ptr, gs, w0, w1, w2, w3, pid_m, pid_k, col64_ptr, col_s_ptr, M, K, R: tl.constexpr,
            BK: tl.constexpr, RHT: tl.constexpr, TWO_D: tl.constexpr, SR: tl.constexpr, EVEN: tl.constexpr):
    """Columnwise direction (16 along M, × 16 along K if ``TWO_D``), optionally in the
    Hadamard domain, global decode scale ``gs``; SR noise of set ``j`` from byte ``j % 4`` of
    the random words ``w{j / 4}``."""
    if RHT:
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _rht16(
            x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, t_ptr)
    bs, enc = _block_scale(_max16(
        _kmax(x0, R, BK, TWO_D), _kmax(x1, R, BK, TWO_D), _kmax(x2, R, BK, TWO_D),
        _kmax(x3, R, BK, TWO_D), _kmax(x4, R, BK, TWO_D), _kmax(x5, R, BK, TWO_D),
        _kmax(x6, R, BK, TWO_D), _kmax(x7, R, BK, TWO_D), _kmax(x8, R, BK, TWO_D),
        _kmax(x9, R, BK, TWO_D), _kmax(x10, R, BK, TWO_D), _kmax(x11, R, BK, TWO_D),
        _kmax(x12, R, BK, TWO_D), _kmax(x13, R, BK, TWO_D), _kmax(x14, R, BK, TWO_D),
        _kmax(x15, R, BK, TWO_D)), gs)
    w_lo = _codes8(x0, x1, x2, x3, x4, x5, x6, x7, enc, w0, w1, R, BK, TWO_D, SR)
    w_hi = _codes8(x8, x9, x10, x11, x12, x13, x14, x15, enc, w2, w3, R, BK, TWO_D, SR)
    _store_col(w_lo, w_hi, bs, col64_ptr, col_s_ptr, pid_m, pid_k, M, K, R, BK, TWO_D, EVEN)


@triton.jit
def nvfp4_quantize_kernel(
    x_ptr, t_ptr, amax_ptr, seed_ptr, row_ptr, row_s_ptr, col64_ptr, col_s_ptr, gs_row_ptr, gs_col_ptr, M, K,
    stride_m,
    ROW: tl.constexpr, COL: tl.constexpr, DERIVE_COL: tl.constexpr, RHT: tl.constexpr,
    SR: tl.constexpr, TWO_D: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr,
):
    """One ``[BM, BK]`` tile → rowwise ``data [M, K/2]`` + scales and/or columnwise
    ``data [K, M/2]`` (``col64_ptr``: its int64 view ``[K, M/16]``) + scales. ``amax_ptr``:
    fp32 per-tensor amax of ``x`` and, with ``RHT``, of its column-Hadamard transform (the
    columnwise direction's); the global decode scales are computed here (every program, the
    same scalar ops as ``formats.nvfp4.nvfp4_global_scale``) and program (0, 0) writes them
    to ``gs_row_ptr`` / ``gs_col_ptr`` (fp32 scalars). ``t_ptr``: fp32 ``T[0, :]``;
    ``seed_ptr``: int64."""
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    gs_row = global_decode_scale(tl.load(amax_ptr))
    gs_col = global_decode_scale(tl.load(amax_ptr + 1)) if RHT else gs_row
    if (pid_m == 0) & (pid_k == 0):
        tl.store(gs_row_ptr, gs_row)
        tl.store(gs_col_ptr, gs_col)
    R: tl.constexpr = BM // 16
    rs = pid_m * BM + tl.arange(0, R)[:, None] * 16  # first row of each 16-row group
    rk = pid_k * BK + tl.arange(0, BK)[None, :]
    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _load16(x_ptr, rs, rk, M, K, stride_m, EVEN)
    # SR: Philox counters of the tile's (16-row group, column) pairs, uint32 (module doc)
    ctr = same_layout(((rs // 16) * K + rk).to(tl.uint32), x0)
    w0, w1, w2, w3 = ctr, ctr, ctr, ctr  # unused without SR
    if ROW or DERIVE_COL:
        if SR:
            w0, w1, w2, w3 = tl.randint4x(tl.load(seed_ptr), ctr)
        _rows16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                gs_row, w0, w1, w2, w3, rs, pid_m, pid_k, row_ptr, row_s_ptr, col64_ptr, col_s_ptr, M, K,
                R, BK, TWO_D, SR, ROW, DERIVE_COL, EVEN)
    if COL and not DERIVE_COL:
        if SR:
            w0, w1, w2, w3 = tl.randint4x(tl.load(seed_ptr), ctr + (tl.cdiv(M, 16) * K).to(tl.uint32))
        _cols16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                t_ptr, gs_col, w0, w1, w2, w3, pid_m, pid_k, col64_ptr, col_s_ptr, M, K, R, BK,
                RHT, TWO_D, SR, EVEN)


@triton.jit
def nvfp4_amax_kernel(x_ptr, t_ptr, amax_ptr, M, K, stride_m, n_tiles_k, n_tiles, RHT: tl.constexpr,
                      BM: tl.constexpr, BK: tl.constexpr):
    """``amax[0] = max|x|``, ``amax[1] = max|RHT(x)|`` (columnwise Hadamard domain) if ``RHT``.
    Each program max-reduces tiles ``pid, pid + P, ...`` then does one atomic per output."""
    R: tl.constexpr = BM // 16
    acc = tl.zeros((R, BK), dtype=tl.float32)
    acc_h = tl.zeros((R, BK), dtype=tl.float32)
    for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        rs = (t // n_tiles_k) * BM + tl.arange(0, R)[:, None] * 16
        rk = (t % n_tiles_k) * BK + tl.arange(0, BK)[None, :]
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _load16(x_ptr, rs, rk, M, K, stride_m,
                                                                                    False)
        acc = tl.maximum(acc, _max16(
            tl.abs(x0), tl.abs(x1), tl.abs(x2), tl.abs(x3), tl.abs(x4), tl.abs(x5), tl.abs(x6), tl.abs(x7),
            tl.abs(x8), tl.abs(x9), tl.abs(x10), tl.abs(x11), tl.abs(x12), tl.abs(x13), tl.abs(x14), tl.abs(x15)))
        if RHT:
            x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _rht16(
                x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, t_ptr)
            acc_h = tl.maximum(acc_h, _max16(
                tl.abs(x0), tl.abs(x1), tl.abs(x2), tl.abs(x3), tl.abs(x4), tl.abs(x5), tl.abs(x6), tl.abs(x7),
                tl.abs(x8), tl.abs(x9), tl.abs(x10), tl.abs(x11), tl.abs(x12), tl.abs(x13), tl.abs(x14), tl.abs(x15)))
    tl.atomic_max(amax_ptr, sem="relaxed", val=tl.max(tl.max(acc, axis=1), axis=0))
    if RHT:
        tl.atomic_max(amax_ptr + 1, sem="relaxed", val=tl.max(tl.max(acc_h, axis=1), axis=0))
