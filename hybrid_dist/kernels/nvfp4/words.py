"""NVFP4 quantize with 1×16 blocks from bf16 read as int32 words: ``nvfp4.tiles``' fused pass
(bitwise its output) for round-to-nearest in both directions, the columnwise direction
optionally in the Hadamard domain (RHT), and stochastic rounding (SR) of one direction.
Outputs as ``formats.nvfp4``: rowwise ``data [M, K/2]`` + E4M3 scales ``[M, K/16]``,
columnwise ``data [K, M/2]`` + ``[K, M/16]``, and the global decode scales.

[Note: words] A program owns ``x[BM, BK]`` as 16 interleaved row sets (``nvfp4.tiles``'
note), each loaded as words ``w_j [BM/16, BK/2]``: word ``c`` holds ``x[., 2c]`` (low half)
and ``x[., 2c+1]`` (high half). Rowwise byte ``c`` is ``code(low) | code(high) << 4``; the
columnwise codes of set ``j`` go into nibble ``j`` of separate even-k and odd-k words; the
columnwise block amax is an unsigned 16×2 max of ``w_j & 0x7FFF7FFF`` over the sets.
[Note: lane quads] ``QUAD`` (both directions, 64×128 tiles, 4 warps): the four lanes that
hold one rowwise block share the scale work of four row sets (``_lane_quad``).
[Note: signs] A code's sign bit is the input's sign bit (``-0.0`` encodes as ``0x8``, as in
``numerics.e2m1_encode``); magnitudes are added into their nibbles (``_e2m1``). An inf in a
block whose encode multiplier is 0 keeps its sign, where the tile kernel's NaN has none.
[Note: row scales in place] Each lane stores its own rowwise scale byte (``_words.st8``).
[Note: even tiles] ``EVEN`` (``M % BM == K % BK == 0``, chosen by the host): no masks.
[Note: RHT] The columnwise direction of each half (even k, odd k) is made for the 16 sets at
once by ``_rht_words``: bitwise the tile kernel's ``T x`` for ``|x| < 2**124``.
[Note: SR] One direction: rowwise (no RHT) or columnwise with RHT, on the tile kernel's
Philox stream (the even k of word ``c`` draw counter ``(m/16)·K + 2c``, the odd k ``+1``;
columnwise counters offset by ``⌈M/16⌉·K``). SR of both directions stays on ``nvfp4.tiles``.

Guarantee: bitwise the reference in every direction for every tensor amax (RHT
within the tile kernel's bound, ``nvfp4.quantize``; SR bitwise the reference fed the same
stream). Why it is built this way: ``docs/design.md`` §8.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybrid_dist.kernels._jit_common import global_decode_scale, same_layout, store_tile
from hybrid_dist.kernels._jit_common import nvfp4_block_scale as _block_scale
from hybrid_dist.kernels.nvfp4._e2m1 import e2m1_mag_into, e2m1_mag_into_rounded
from hybrid_dist.kernels.nvfp4._lane_quad import quad_amax, quad_gather
from hybrid_dist.kernels._words import load8w, load16w_even, st8, umax16x2, unpack
from hybrid_dist.kernels.nvfp4._rht_words import rht_columns
from hybrid_dist.kernels.nvfp4.tiles import _store_col, _store_row_scales4


SIGNS = tl.constexpr(-2147450880)  # 0x80008000: the sign bits of a word's two bf16


def words_lane_quads(config) -> bool:
    """Whether ``config`` lays each row set's words ``[BM/16, BK/2]`` out two per thread with
    row ``i`` on warp ``i`` (``BK = 128``, ``BM = 16·num_warps``): the layout ``_rows_quad``'s
    lane shuffles assume (note above). Other configs compute each row block's scale on every
    lane of it."""
    return config.bk == 128 and config.bm == 16 * config.num_warps


@triton.jit
def _per_word(e, R: tl.constexpr, W: tl.constexpr, G: tl.constexpr):
    """``e [R, W/G]`` repeated over each ``G`` consecutive words: ``[R, W]`` (in-thread)."""
    return tl.reshape(tl.broadcast_to(e[:, :, None], (R, W // G, G)), (R, W))


@triton.jit
def _row_bytes(w, enc, rows, pid_k, row_ptr, M, K, r_e, r_o, B: tl.constexpr, R: tl.constexpr, W: tl.constexpr,
               SR: tl.constexpr, EVEN: tl.constexpr):
    """Rowwise bytes of one set's words ``w [R, W]`` with encode multipliers ``enc [R, W]``
    (one per word), stored (``EVEN``: the tile lies inside ``x``, no masks). ``SR``: the even
    (odd) k take the noise of byte ``B`` of the random words ``r_e`` (``r_o``)."""
    lo, hi = unpack(w)
    pw = pid_k * W + tl.arange(0, W)[None, :]
    t = (w & SIGNS).to(tl.uint32, bitcast=True)
    signs = ((t >> 12) | (t >> 24)).to(tl.int32, bitcast=True)  # bits 3 and 7 (and junk above 8)
    byte = e2m1_mag_into_rounded(hi * enc, e2m1_mag_into_rounded(lo * enc, signs, 0, r_e, B, SR), 1, r_o, B, SR)
    store_tile(row_ptr + rows * (K // 2) + pw, byte.to(tl.uint8), (rows < M) & (pw < K // 2), EVEN)


@triton.jit
def _pset(w, j: tl.constexpr, acc_e, acc_o, enc_lo, enc_hi, gs, rs, pid_k, row_ptr, M, K, r_e, r_o,
          R: tl.constexpr, W: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr, SR: tl.constexpr,
          EVEN: tl.constexpr):
    """Set ``j``: rowwise bytes stored, 1x16 scales ``[R, W/8]`` returned; its columnwise codes
    added into nibble ``j % 8`` of ``acc_e`` (low halves: even k) and ``acc_o`` (odd k)."""
    lo, hi = unpack(w)
    bs = gs
    if ROW:
        ram = tl.max(tl.reshape(tl.maximum(tl.abs(lo), tl.abs(hi)), (R, W // 8, 8)), axis=2)
        bs, enc = _block_scale(ram, gs)
        _row_bytes(w, _per_word(enc, R, W, 8), rs + j, pid_k, row_ptr, M, K, r_e, r_o, j % 4, R, W, SR, EVEN)
    if COL:
        acc_e = e2m1_mag_into(lo * enc_lo, acc_e, j % 8)
        acc_o = e2m1_mag_into(hi * enc_hi, acc_o, j % 8)
    return bs, acc_e, acc_o


@triton.jit
def _signs4(w0, w1, w2, w3):
    """The sign bits of sets ``j < 4`` (words ``w_j``): low half's at bit ``4j + 3``, high
    half's at ``4j + 19``."""
    a = (w0 & SIGNS).to(tl.uint32, bitcast=True) >> 12
    b = (w1 & SIGNS).to(tl.uint32, bitcast=True) >> 8
    c = (w2 & SIGNS).to(tl.uint32, bitcast=True) >> 4
    return (a | b | c).to(tl.int32, bitcast=True) | (w3 & SIGNS)


@triton.jit
def _col_signs(w0, w1, w2, w3, w4, w5, w6, w7):
    """Columnwise accumulators of sets 0-7 holding only their E2M1 sign bits: even k (low
    halves) and odd k (high halves), set ``j`` in nibble ``j``."""
    a = _signs4(w0, w1, w2, w3).to(tl.uint32, bitcast=True)
    b = _signs4(w4, w5, w6, w7).to(tl.uint32, bitcast=True)
    even = (a & 0xFFFF) | (b << 16)
    odd = (a >> 16) | (b & 0xFFFF0000)
    return even.to(tl.int32, bitcast=True), odd.to(tl.int32, bitcast=True)


@triton.jit
def _pair_amax(w, R: tl.constexpr, W: tl.constexpr):
    """``max |x|`` over the 4 elements of words ``2c, 2c+1``: ``[R, W/2]`` (in-thread)."""
    lo, hi = unpack(w)
    return tl.max(tl.reshape(tl.maximum(tl.abs(lo), tl.abs(hi)), (R, W // 2, 2)), axis=2)


@triton.jit
def _rows_quad(w0, w1, w2, w3, j0: tl.constexpr, gs, rs, pid_m, pid_k, row_ptr, row_s_ptr, M, K, r_e, r_o,
               R: tl.constexpr, W: tl.constexpr, SR: tl.constexpr, EVEN: tl.constexpr):
    """Rowwise of sets ``j0 .. j0+3`` with each 1×16 block scale computed once: a row block is
    the 8 words of a lane quad (``W = 64``: words ``2c, 2c+1`` on lane ``c``), so lane ``c``
    reduces and scales set ``j0 + c % 4`` (``_lane_quad``) where each of the four lanes used
    to compute all four; the encode multipliers are then gathered back over the quad. Each
    lane stores its own scale byte: row ``16i + j0 + c % 4`` of the tile, block ``c / 4``."""
    C: tl.constexpr = W // 2
    c = tl.arange(0, C)[None, :]
    amax = quad_amax(_pair_amax(w0, R, W), _pair_amax(w1, R, W), _pair_amax(w2, R, W), _pair_amax(w3, R, W),
                     c, R, C)
    bs, enc = _block_scale(amax, gs)
    e0, e1, e2, e3 = quad_gather(enc, R, C)
    _row_bytes(w0, _per_word(e0, R, W, 2), rs + j0, pid_k, row_ptr, M, K, r_e, r_o, 0, R, W, SR, EVEN)
    _row_bytes(w1, _per_word(e1, R, W, 2), rs + j0 + 1, pid_k, row_ptr, M, K, r_e, r_o, 1, R, W, SR, EVEN)
    _row_bytes(w2, _per_word(e2, R, W, 2), rs + j0 + 2, pid_k, row_ptr, M, K, r_e, r_o, 2, R, W, SR, EVEN)
    _row_bytes(w3, _per_word(e3, R, W, 2), rs + j0 + 3, pid_k, row_ptr, M, K, r_e, r_o, 3, R, W, SR, EVEN)
    rows = rs + j0 + c % 4
    sk = pid_k * (W // 8) + c // 4
    # in place (st8): a tl.store moved the scales through shared memory, a barrier per 4 sets
    p = row_s_ptr.to(tl.pointer_type(tl.uint8)) + rows * (K // 16) + sk
    ok = tl.full(rows.shape, 1, tl.int1) if EVEN else (rows < M) & (sk < K // 16)
    st8(p, bs.to(tl.uint8, bitcast=True).to(tl.int32), ok)


@triton.jit
def _pset4(w0, w1, w2, w3, j0: tl.constexpr, acc_e, acc_o, enc_lo, enc_hi, gs, rs, pid_m, pid_k,
           row_ptr, row_s_ptr, M, K, r_e, r_o, R: tl.constexpr, W: tl.constexpr, ROW: tl.constexpr,
           COL: tl.constexpr, QUAD: tl.constexpr, SR: tl.constexpr, EVEN: tl.constexpr):
    """Sets ``j0 .. j0+3`` (see ``_pset``); their row scales stored together (``QUAD``: by
    ``_rows_quad``, before the columnwise codes). ``SR``: rowwise noise of set ``j`` from byte
    ``j % 4`` of the random words ``r_e`` (even k) and ``r_o`` (odd k)."""
    if ROW and QUAD:
        _rows_quad(w0, w1, w2, w3, j0, gs, rs, pid_m, pid_k, row_ptr, row_s_ptr, M, K, r_e, r_o, R, W, SR, EVEN)
    ROW_SET: tl.constexpr = ROW and not QUAD
    s0, acc_e, acc_o = _pset(w0, j0, acc_e, acc_o, enc_lo, enc_hi, gs, rs, pid_k, row_ptr, M, K, r_e, r_o,
                             R, W, ROW_SET, COL, SR, EVEN)
    s1, acc_e, acc_o = _pset(w1, j0 + 1, acc_e, acc_o, enc_lo, enc_hi, gs, rs, pid_k, row_ptr, M,
                             K, r_e, r_o, R, W, ROW_SET, COL, SR, EVEN)
    s2, acc_e, acc_o = _pset(w2, j0 + 2, acc_e, acc_o, enc_lo, enc_hi, gs, rs, pid_k, row_ptr, M,
                             K, r_e, r_o, R, W, ROW_SET, COL, SR, EVEN)
    s3, acc_e, acc_o = _pset(w3, j0 + 3, acc_e, acc_o, enc_lo, enc_hi, gs, rs, pid_k, row_ptr, M,
                             K, r_e, r_o, R, W, ROW_SET, COL, SR, EVEN)
    if ROW_SET:
        _store_row_scales4(s0, s1, s2, s3, j0, row_s_ptr, pid_m, pid_k, M, K, R, W * 2, EVEN)
    return acc_e, acc_o


@triton.jit
def _seed(seed_ptr, SR: tl.constexpr):
    """The int64 Philox key with ``SR`` (else 0, unread)."""
    seed = tl.full([], 0, tl.int64)
    if SR:
        seed = tl.load(seed_ptr)
    return seed


@triton.jit
def _row_noise(seed_ptr, ctr, SR: tl.constexpr):
    """With ``SR``, the rowwise random words of each word pair's even k (``tl.randint4x`` at the
    counters ``ctr``) and odd k (``ctr + 1``): ``(e0, e1, e2, e3, o0, o1, o2, o3)``; else
    ``ctr`` eight times (unused)."""
    if SR:
        seed = tl.load(seed_ptr)
        e0, e1, e2, e3 = tl.randint4x(seed, ctr)
        o0, o1, o2, o3 = tl.randint4x(seed, ctr + 1)
        return e0, e1, e2, e3, o0, o1, o2, o3
    return ctr, ctr, ctr, ctr, ctr, ctr, ctr, ctr


@triton.jit
def _load16w(x_ptr, rs, rw, M, KW, stride_w, EVEN: tl.constexpr):
    """The 16 row sets as words ``w_j = x[rs + j, words rw]`` (int32 ``[R, W]``), 0 outside
    (``EVEN``: nothing is outside)."""
    p = x_ptr + rs * stride_w + rw
    if EVEN:
        w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15 = load16w_even(p, stride_w)
    else:
        mk = rw < KW
        w0, w1, w2, w3, w4, w5, w6, w7 = load8w(p, rs, mk, M, stride_w)
        w8, w9, w10, w11, w12, w13, w14, w15 = load8w(p + 8 * stride_w, rs + 8, mk, M, stride_w)
    return w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15


@triton.jit
def _colmax16(w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15):
    """Per half, the bits of ``max_j |x_j|`` (the columnwise block amax of both k of a word)."""
    m = 0x7FFF7FFF
    a = umax16x2(umax16x2(w0 & m, w1 & m), umax16x2(w2 & m, w3 & m))
    b = umax16x2(umax16x2(w4 & m, w5 & m), umax16x2(w6 & m, w7 & m))
    c = umax16x2(umax16x2(w8 & m, w9 & m), umax16x2(w10 & m, w11 & m))
    d = umax16x2(umax16x2(w12 & m, w13 & m), umax16x2(w14 & m, w15 & m))
    return umax16x2(umax16x2(a, b), umax16x2(c, d))


@triton.jit
def nvfp4_words_kernel(
    x_ptr, t_ptr, amax_ptr, seed_ptr, row_ptr, row_s_ptr, col64_ptr, col_s_ptr, gs_row_ptr, gs_col_ptr, M, K,
    stride_w, ROW: tl.constexpr, COL: tl.constexpr, RHT: tl.constexpr, SR: tl.constexpr, BM: tl.constexpr,
    BK: tl.constexpr, QUAD: tl.constexpr, EVEN: tl.constexpr,
):
    """One ``[BM, BK]`` tile → rowwise ``data [M, K/2]`` + 1×16 scales and/or columnwise
    ``data [K, M/2]`` (``col64_ptr``: its int64 view ``[K, M/16]``) + scales, as
    ``tiles.nvfp4_quantize_kernel`` without 2D blocks (bitwise its output, RHT and SR
    included; with SR one direction, a columnwise one with RHT: note "SR"). ``x_ptr``: the bf16 input
    as int32 words ``[M, K/2]`` (row stride ``stride_w`` words); ``amax_ptr``: fp32 ``max|x|``
    and, with ``RHT``, ``max|RHT(x)|`` (the global decode scales, written by program (0, 0));
    ``t_ptr``: fp32 ``T[0, :]`` (read with ``RHT``); ``seed_ptr``: int64, the Philox key (read
    with ``SR``). ``EVEN``: ``M % BM == K % BK == 0`` and ``x`` not empty, so no load or store
    needs a mask (sm_90 SASS: 35.5 → 34.6 instructions per element, 42.5 → 41.1 with RHT)."""
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    gs = global_decode_scale(tl.load(amax_ptr))
    gs_col = global_decode_scale(tl.load(amax_ptr + 1)) if RHT else gs
    if (pid_m == 0) & (pid_k == 0):
        tl.store(gs_row_ptr, gs)
        tl.store(gs_col_ptr, gs_col)
    R: tl.constexpr = BM // 16
    W: tl.constexpr = BK // 2
    rs = pid_m * BM + tl.arange(0, R)[:, None] * 16
    rw = pid_k * W + tl.arange(0, W)[None, :]
    w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15 = _load16w(x_ptr, rs, rw, M, K // 2,
                                                                                  stride_w, EVEN)
    enc_lo, enc_hi, bs_lo, bs_hi = gs, gs, gs, gs
    SET_COL: tl.constexpr = COL and not RHT  # columnwise codes made set by set (no transform)
    tl.static_assert(not SR or (ROW != COL and not SET_COL), "nvfp4.words: SR makes one direction (note \"SR\")")
    # SR: the tile kernel's Philox counters (uint32) of the even k of each (16-row group, word)
    ctr = same_layout(((rs // 16) * K + 2 * rw).to(tl.uint32), w0)
    re0, re1, re2, re3, ro0, ro1, ro2, ro3 = _row_noise(seed_ptr, ctr, SR and ROW)
    if SET_COL:
        cam_lo, cam_hi = unpack(_colmax16(w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15))
        bs_lo, enc_lo = _block_scale(cam_lo, gs)
        bs_hi, enc_hi = _block_scale(cam_hi, gs)
    z = tl.zeros((R, W), tl.int32)
    se_lo, so_lo, se_hi, so_hi = z, z, z, z
    if SET_COL:  # the columnwise accumulators start from the signs (note "signs")
        se_lo, so_lo = _col_signs(w0, w1, w2, w3, w4, w5, w6, w7)
        se_hi, so_hi = _col_signs(w8, w9, w10, w11, w12, w13, w14, w15)
    e_lo, o_lo = _pset4(w0, w1, w2, w3, 0, se_lo, so_lo, enc_lo, enc_hi, gs, rs, pid_m, pid_k, row_ptr,
                        row_s_ptr, M, K, re0, ro0, R, W, ROW, SET_COL, QUAD, SR, EVEN)
    e_lo, o_lo = _pset4(w4, w5, w6, w7, 4, e_lo, o_lo, enc_lo, enc_hi, gs, rs, pid_m, pid_k,
                        row_ptr, row_s_ptr, M, K, re1, ro1, R, W, ROW, SET_COL, QUAD, SR, EVEN)
    e_hi, o_hi = _pset4(w8, w9, w10, w11, 8, se_hi, so_hi, enc_lo, enc_hi, gs, rs, pid_m, pid_k, row_ptr,
                        row_s_ptr, M, K, re2, ro2, R, W, ROW, SET_COL, QUAD, SR, EVEN)
    e_hi, o_hi = _pset4(w12, w13, w14, w15, 12, e_hi, o_hi, enc_lo, enc_hi, gs, rs, pid_m, pid_k,
                        row_ptr, row_s_ptr, M, K, re3, ro3, R, W, ROW, SET_COL, QUAD, SR, EVEN)
    if COL and RHT:  # note "RHT"; SR: the columnwise counters follow the rowwise ones (note "SR")
        bs_lo, e_lo, e_hi, bs_hi, o_lo, o_hi = rht_columns(w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12,
                                                           w13, w14, w15, t_ptr, gs_col, _seed(seed_ptr, SR),
                                                           ctr + (tl.cdiv(M, 16) * K).to(tl.uint32), SR)
    if COL:
        w_lo = tl.reshape(tl.join(e_lo, o_lo), (R, BK))
        w_hi = tl.reshape(tl.join(e_hi, o_hi), (R, BK))
        bs = tl.reshape(tl.join(bs_lo.to(tl.float32), bs_hi.to(tl.float32)), (R, BK))
        _store_col(w_lo, w_hi, bs, col64_ptr, col_s_ptr, pid_m, pid_k, M, K, R, BK, False, EVEN)
