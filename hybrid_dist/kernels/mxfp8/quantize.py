"""MXFP8 fused quantize: one read of a ``[32, BK]`` tile makes both directions.

Rowwise: 1×32 blocks along K → ``data [M, K]``, ``scale [M, K/32]`` (uint8 E8M0).
Columnwise: 32×1 blocks along M, stored transposed → ``data [K, M]``, ``scale [K, M/32]``.
Per block ``e = RCEIL(amax / fp8_max)``, ``q = sat(x · 2**(127-e))`` — the same IEEE
operations as ``formats.mxfp8.mxfp8_quantize_rows``, so the result is bitwise equal.

[Note: 32 row sets] A program owns rows ``m0 .. m0+31`` (one columnwise block) and
columns ``k0 .. k0+BK``, and loads each row as its own ``[BK]`` tensor ``x_j`` — all 32 in
one register layout, so a thread holds the same k's of every row:

* rowwise: each ``x_j`` reduces over its 1×32 blocks along K (shuffles), is cast and
  stored; the 32 rows' scales are stored together once ``[BK/32, 32]``;
* columnwise: the rows are joined into ``y [BK, 32]`` (``y[:, j] = x_j``, the join adds
  no data movement), so the block amax is a max inside each thread, and ``q [BK, 32]`` is
  stored as it is: ``BK`` rows of 32 contiguous bytes of ``data [K, M]`` (Triton stages the
  store through shared memory to coalesce it). No 8-bit register transpose.

Every load is issued before the first store: the stores may alias the input as far as the
compiler knows, so it would not hoist a load over them (one load in flight at a time). bf16
inputs use the short E8M0 helpers for bf16-valued amax (``_jit_common.e8m0_rceil_bf16``).
Tile configs: ``mxfp8.configs`` (``bm`` must be 32).

Dispatch (``mxfp8_quantize_op``): with a columnwise direction, bf16 that reads as int32
words takes ``mxfp8.words``; every other input, and rowwise only, takes this kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_dist.formats.mxfp8 import MX_BLOCK, MXFP8Quantizer, MXFP8Storage
from hybrid_dist.formats.numerics import FP8_MAX
from hybrid_dist.kernels._jit_common import (cast_fp8, cdiv, e8m0_inv_bf16, e8m0_rceil, e8m0_rceil_bf16, eager_or_op,
                                             exp2_int)
from hybrid_dist.kernels._launch import launch
from hybrid_dist.kernels.mxfp8.words import mxfp8_words_kernel
from hybrid_dist.kernels.mxfp8.configs import MXFP8_DEFAULT, MXFP8_WORDS_DEFAULT
from hybrid_dist.kernels.tile_config import TileConfig, bf16_words
from hybrid_dist.kernels.scale_staging import new_stage, stage_unit, unstage
from hybrid_dist.library_op import library_op


@triton.jit
def _e8m0(amax, E5M2: tl.constexpr, BF16: tl.constexpr):
    """(E8M0 code, fp32 multiplier ``2**(127-e)``) of a block amax."""
    if BF16:
        e = e8m0_rceil_bf16(amax, E5M2)
        return e, e8m0_inv_bf16(e)
    else:
        e = e8m0_rceil(amax, E5M2)
        return e, exp2_int(127 - e)


@triton.jit
def _load(x_ptr, m, rk, M, K, stride_m, EVEN: tl.constexpr):
    """Row ``m`` at columns ``rk`` as fp32 ``[BK]`` (zeros outside ``[M, K]``)."""
    if EVEN:
        return tl.load(x_ptr + m * stride_m + rk).to(tl.float32)
    else:
        return tl.load(x_ptr + m * stride_m + rk, mask=(m < M) & (rk < K), other=0.0).to(tl.float32)


@triton.jit
def _load8(x_ptr, m, rk, M, K, stride_m, EVEN: tl.constexpr):
    return (_load(x_ptr, m, rk, M, K, stride_m, EVEN), _load(x_ptr, m + 1, rk, M, K, stride_m, EVEN),
            _load(x_ptr, m + 2, rk, M, K, stride_m, EVEN), _load(x_ptr, m + 3, rk, M, K, stride_m, EVEN),
            _load(x_ptr, m + 4, rk, M, K, stride_m, EVEN), _load(x_ptr, m + 5, rk, M, K, stride_m, EVEN),
            _load(x_ptr, m + 6, rk, M, K, stride_m, EVEN), _load(x_ptr, m + 7, rk, M, K, stride_m, EVEN))


@triton.jit
def _row(x, m, rk, row_ptr, M, K, FMAX: tl.constexpr, E5M2: tl.constexpr, BF16: tl.constexpr,
         BK: tl.constexpr, EVEN: tl.constexpr):
    """Rowwise quantize + store of row ``m`` (``x [BK]``); returns its E8M0 codes ``[BK/32]``."""
    blocks = tl.reshape(x, (BK // 32, 32))
    e, inv = _e8m0(tl.max(tl.abs(blocks), axis=1), E5M2, BF16)
    q = tl.reshape(cast_fp8(blocks * inv[:, None], FMAX, row_ptr.dtype.element_ty), (BK,))
    if EVEN:
        tl.store(row_ptr + m * K + rk, q)
    else:
        tl.store(row_ptr + m * K + rk, q, mask=(m < M) & (rk < K))
    return e


@triton.jit
def _rows8(x0, x1, x2, x3, x4, x5, x6, x7, m, rk, row_ptr, M, K, FMAX: tl.constexpr, E5M2: tl.constexpr,
           BF16: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr):
    return (_row(x0, m, rk, row_ptr, M, K, FMAX, E5M2, BF16, BK, EVEN),
            _row(x1, m + 1, rk, row_ptr, M, K, FMAX, E5M2, BF16, BK, EVEN),
            _row(x2, m + 2, rk, row_ptr, M, K, FMAX, E5M2, BF16, BK, EVEN),
            _row(x3, m + 3, rk, row_ptr, M, K, FMAX, E5M2, BF16, BK, EVEN),
            _row(x4, m + 4, rk, row_ptr, M, K, FMAX, E5M2, BF16, BK, EVEN),
            _row(x5, m + 5, rk, row_ptr, M, K, FMAX, E5M2, BF16, BK, EVEN),
            _row(x6, m + 6, rk, row_ptr, M, K, FMAX, E5M2, BF16, BK, EVEN),
            _row(x7, m + 7, rk, row_ptr, M, K, FMAX, E5M2, BF16, BK, EVEN))


@triton.jit
def _join32(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19, a20,
            a21, a22, a23, a24, a25, a26, a27, a28, a29, a30, a31):
    """``[N]`` × 32 → ``[N, 32]`` with column ``j`` = ``a_j``: join level ``l`` pairs ``j`` and
    ``j + 16 / 2**l``, so the joined dims flatten to ``j``."""
    return tl.reshape(tl.join(
        tl.join(tl.join(tl.join(tl.join(a0, a16), tl.join(a8, a24)), tl.join(tl.join(a4, a20), tl.join(a12, a28))),
                tl.join(tl.join(tl.join(a2, a18), tl.join(a10, a26)), tl.join(tl.join(a6, a22), tl.join(a14, a30)))),
        tl.join(tl.join(tl.join(tl.join(a1, a17), tl.join(a9, a25)), tl.join(tl.join(a5, a21), tl.join(a13, a29))),
                tl.join(tl.join(tl.join(a3, a19), tl.join(a11, a27)), tl.join(tl.join(a7, a23), tl.join(a15, a31))))),
        (a0.shape[0], 32))


@triton.jit
def _mxfp8_kernel(
    x_ptr, row_ptr, row_s_ptr, col_ptr, col_s_ptr, M, K, stride_m,
    FMAX: tl.constexpr, E5M2: tl.constexpr, BF16: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr,
    BK: tl.constexpr, EVEN: tl.constexpr,
):
    """Rows ``32·pid_m ..`` × columns ``BK·pid_k ..`` (module note). ``EVEN``: ``M % 32 == 0``
    and ``K % BK == 0`` (no masks); columnwise needs ``M % 32 == 0``."""
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    m0 = pid_m * 32
    rk = pid_k * BK + tl.arange(0, BK)
    x0, x1, x2, x3, x4, x5, x6, x7 = _load8(x_ptr, m0, rk, M, K, stride_m, EVEN)
    x8, x9, x10, x11, x12, x13, x14, x15 = _load8(x_ptr, m0 + 8, rk, M, K, stride_m, EVEN)
    x16, x17, x18, x19, x20, x21, x22, x23 = _load8(x_ptr, m0 + 16, rk, M, K, stride_m, EVEN)
    x24, x25, x26, x27, x28, x29, x30, x31 = _load8(x_ptr, m0 + 24, rk, M, K, stride_m, EVEN)
    if ROW:
        e0, e1, e2, e3, e4, e5, e6, e7 = _rows8(
            x0, x1, x2, x3, x4, x5, x6, x7, m0, rk, row_ptr, M, K, FMAX, E5M2, BF16, BK, EVEN)
        e8, e9, e10, e11, e12, e13, e14, e15 = _rows8(
            x8, x9, x10, x11, x12, x13, x14, x15, m0 + 8, rk, row_ptr, M, K, FMAX, E5M2, BF16, BK, EVEN)
        e16, e17, e18, e19, e20, e21, e22, e23 = _rows8(
            x16, x17, x18, x19, x20, x21, x22, x23, m0 + 16, rk, row_ptr, M, K, FMAX, E5M2, BF16, BK, EVEN)
        e24, e25, e26, e27, e28, e29, e30, e31 = _rows8(
            x24, x25, x26, x27, x28, x29, x30, x31, m0 + 24, rk, row_ptr, M, K, FMAX, E5M2, BF16, BK, EVEN)
        es = _join32(e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11, e12, e13, e14, e15, e16, e17, e18,
                     e19, e20, e21, e22, e23, e24, e25, e26, e27, e28, e29, e30, e31).to(tl.uint8)  # [BK/32, 32]
        sk = pid_k * (BK // 32) + tl.arange(0, BK // 32)[:, None]
        sm = m0 + tl.arange(0, 32)[None, :]
        if EVEN:
            tl.store(row_s_ptr + sm * (K // 32) + sk, es)
        else:
            tl.store(row_s_ptr + sm * (K // 32) + sk, es, mask=(sm < M) & (sk < K // 32))
    if COL:
        y = _join32(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, x16, x17, x18, x19,
                    x20, x21, x22, x23, x24, x25, x26, x27, x28, x29, x30, x31)  # [BK, 32]
        e, inv = _e8m0(tl.max(tl.abs(y), axis=1), E5M2, BF16)  # [BK]
        q = cast_fp8(y * inv[:, None], FMAX, col_ptr.dtype.element_ty)
        cm = m0 + tl.arange(0, 32)[None, :]
        if EVEN:
            tl.store(col_ptr + rk[:, None] * M + cm, q)
            tl.store(col_s_ptr + rk * (M // 32) + pid_m, e.to(tl.uint8))
        else:
            tl.store(col_ptr + rk[:, None] * M + cm, q, mask=(rk[:, None] < K) & (cm < M))
            tl.store(col_s_ptr + rk * (M // 32) + pid_m, e.to(tl.uint8), mask=rk < K)


def _mxfp8_shapes(m, k, rowwise, columnwise):
    return [((m, k) if rowwise else (0, 0)), ((m, k // MX_BLOCK) if rowwise else (0, 0)),
            ((k, m) if columnwise else (0, 0)), ((k, m // MX_BLOCK) if columnwise else (0, 0))]


def _words(x, rowwise, columnwise):
    """The words kernel applies: columnwise requested, word-readable bf16 and the shape rules
    of every requested direction (``M % 32``; ``K % 32`` with rowwise)."""
    m, k = x.shape
    return columnwise and bf16_words(x) and m % 32 == 0 and (not rowwise or k % 32 == 0)


def _launch_words(x, row, row_s, col, col_s, dtype, rowwise, config):
    """``mxfp8_words_kernel`` into the outputs; its scales through ``scale_staging``."""
    m, k = x.shape
    bm, bk = config.bm, config.bk
    ur, uc = stage_unit(bk // 32), stage_unit(bm // 32)
    dev = x.device
    stage_r = new_stage(m if rowwise else 0, k // 32 if rowwise else 0, ur, dev)
    stage_c = new_stage(k, m // 32, uc, dev)
    xw = x.view(torch.int32)
    row64 = row.view(torch.int64) if rowwise else torch.empty(0, dtype=torch.int64, device=dev)
    launch(
        mxfp8_words_kernel, (cdiv(k, bk), cdiv(m, bm)), xw, row64, stage_r.view(torch.uint8), col.view(torch.int64),
        stage_c.view(torch.uint8), m, k,
        max(xw.stride(0), 1), E5M2=dtype == torch.float8_e5m2, ROW=rowwise, BM=bm, BK=bk,
        EVEN=m % bm == 0 and k % bk == 0, UR=ur, UC=uc, **config.launch_options(dev))
    unstage((row_s, stage_r), (col_s, stage_c))


def mxfp8_quantize_tiles(x: torch.Tensor, dtype: torch.dtype, rowwise: bool, columnwise: bool,
                         config: TileConfig | None = None, *, words: bool | None = None):
    """Launch on ``x [M, K]`` (unit stride along K; ``M % 32 == 0`` for columnwise):
    ``(row [M,K], row_scale [M,K/32], col [K,M], col_scale [K,M/32])``; absent ones empty.

    ``words=None``: with columnwise, bf16 that reads as int32 words goes to ``mxfp8.words``
    (default ``MXFP8_WORDS_DEFAULT``), anything else to the 32-row-set kernel here
    (``MXFP8_DEFAULT``); ``False`` forces the row-set kernel, ``True`` the words kernel."""
    can = _words(x, rowwise, columnwise)
    if words and not can:
        raise ValueError(f"the MXFP8 words kernel needs columnwise, word-aligned bf16 and M % 32 == 0 "
                         f"(K % 32 == 0 with rowwise); got {x.dtype} {tuple(x.shape)} rowwise={rowwise} "
                         f"columnwise={columnwise}")
    words = can if words is None else words
    config = config or (MXFP8_WORDS_DEFAULT if words else MXFP8_DEFAULT)
    if not words and config.bm != 32:
        raise ValueError(f"MXFP8 quantize tiles are 32 rows (one columnwise block); got {config}")
    m, k = x.shape
    s_row, s_rs, s_col, s_cs = _mxfp8_shapes(m, k, rowwise, columnwise)
    dev = x.device
    row = torch.empty(s_row, dtype=dtype, device=dev)
    row_s = torch.empty(s_rs, dtype=torch.uint8, device=dev)
    col = torch.empty(s_col, dtype=dtype, device=dev)
    col_s = torch.empty(s_cs, dtype=torch.uint8, device=dev)
    if not x.numel():
        return row, row_s, col, col_s
    if words:
        _launch_words(x, row, row_s, col, col_s, dtype, rowwise, config)
    else:
        grid = (cdiv(m, config.bm), cdiv(k, config.bk))
        launch(_mxfp8_kernel, grid, x, row, row_s, col, col_s, m, k, x.stride(0), FMAX=FP8_MAX[dtype],
               E5M2=dtype == torch.float8_e5m2, BF16=x.dtype == torch.bfloat16, ROW=rowwise, COL=columnwise,
               BK=config.bk, EVEN=m % 32 == 0 and k % config.bk == 0, num_warps=config.num_warps)
    return row, row_s, col, col_s


@library_op("hybrid_dist::mxfp8_quantize")
def mxfp8_quantize_op(
    x: torch.Tensor, dtype: torch.dtype, rowwise: bool, columnwise: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(row [M,K], row_scale [M,K/32], col [K,M], col_scale [K,M/32])``; absent ones empty.

    With columnwise: ``mxfp8.words`` for word-readable bf16, else the 32-row-set kernel;
    rowwise only: the 32-row-set kernel (masked rows when ``M % 32 != 0``)."""
    return mxfp8_quantize_tiles(x, dtype, rowwise, columnwise)


@mxfp8_quantize_op.register_fake
def _(x, dtype, rowwise, columnwise):
    m, k = x.shape
    s_row, s_rs, s_col, s_cs = _mxfp8_shapes(m, k, rowwise, columnwise)
    return (x.new_empty(s_row, dtype=dtype), x.new_empty(s_rs, dtype=torch.uint8),
            x.new_empty(s_col, dtype=dtype), x.new_empty(s_cs, dtype=torch.uint8))


def quantize_mxfp8(q: MXFP8Quantizer, x2d, *, rowwise, columnwise, state, amax, config: TileConfig | None = None):
    """Registry impl for :class:`MXFP8Quantizer` (bitwise the reference; any float input: the
    32-row-set kernel builds columnwise blocks without an 8-bit transpose). ``config``: a
    tile config other than the default (eager only: tests and benchmarks)."""
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    if config is None:
        row, row_s, col, col_s = mxfp8_quantize(x2d, q.dtype, rowwise, columnwise)
    else:
        row, row_s, col, col_s = mxfp8_quantize_tiles(x2d, q.dtype, rowwise, columnwise, config)
    row_st = MXFP8Storage(data=row, scale=row_s, transposed=False) if rowwise else None
    col_st = MXFP8Storage(data=col, scale=col_s, transposed=True) if columnwise else None
    return row_st, col_st


mxfp8_quantize = eager_or_op(mxfp8_quantize_op, mxfp8_quantize_op.fn)
