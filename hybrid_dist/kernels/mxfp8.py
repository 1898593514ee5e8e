"""MXFP8 fused quantize: one read of an ``[BM, BK]`` tile makes both directions.

Rowwise: 1×32 blocks along K → ``data [M, K]``, ``scale [M, K/32]`` (uint8 E8M0).
Columnwise: 32×1 blocks along M, stored transposed → ``data [K, M]``, ``scale [K, M/32]``.
Per block ``e = RCEIL(amax / fp8_max)``, ``q = sat(x · 2**(127-e))`` — the same IEEE
operations as ``formats.mxfp8.mxfp8_quantize_rows``, so the result is bitwise equal.

[Note: interleaved row sets] The tile is loaded as 4 row sets ``x_j = x[m ≡ j mod 4]``
(each ``[BM/4, BK]``, all in one register layout). Columnwise:

* block amax = elementwise max over the sets of each set's max over 8 rows;
* the 4 fp8 bytes of ``m = 4i .. 4i+3`` come from the same thread (one per set), so they are
  packed into one int32 **before** the transpose; the transpose moves 32-bit words and
  the ``[K, M]`` store writes ``[BK, BM/4]`` int32 (rows of ``BM`` contiguous bytes).

Tile configs: ``kernels.quant_tiles`` (``benchmarks/quantize.py --sweep`` times them).
The registered default path (``quantize_mxfp8`` without ``config``, and the torch.library
op) runs the v1 kernel (``mxfp8_v1``): measured faster on an H100 and an H200 than this
kernel at every tile config; this kernel runs for an explicit ``config``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_dist.formats._numerics import FP8_MAX
from hybrid_dist.formats.mxfp8 import MX_BLOCK, MXFP8Quantizer, MXFP8Storage
from hybrid_dist.kernels._jit_common import cdiv, eager_or_op, cast_fp8, e8m0_rceil, exp2_int
from hybrid_dist.kernels.quant_tiles import MXFP8_DEFAULT, TileConfig


@triton.jit
def _to_fp8(v, FMAX: tl.constexpr, E5M2: tl.constexpr):
    if E5M2:
        return cast_fp8(v, FMAX, tl.float8e5)
    else:
        return cast_fp8(v, FMAX, tl.float8e4nv)


@triton.jit
def _load_set(x_ptr, rows, rk, M, K, stride_m):
    return tl.load(x_ptr + rows * stride_m + rk, mask=(rows < M) & (rk < K), other=0.0).to(tl.float32)


@triton.jit
def _rows_set(x, rows, rk, row_ptr, row_s_ptr, pid_k, M, K, FMAX: tl.constexpr, E5M2: tl.constexpr,
              R: tl.constexpr, BK: tl.constexpr):
    """Rowwise (1×32 along K) quantize + store of one row set ``x [R, BK]`` (rows ``rows``)."""
    blocks = tl.reshape(x, (R, BK // 32, 32))
    e = e8m0_rceil(tl.max(tl.abs(blocks), axis=2), E5M2)  # [R, BK/32]
    q = _to_fp8(blocks * exp2_int(127 - e)[:, :, None], FMAX, E5M2)
    tl.store(row_ptr + rows * K + rk, tl.reshape(q, (R, BK)), mask=(rows < M) & (rk < K))
    sk = pid_k * (BK // 32) + tl.arange(0, BK // 32)[None, :]
    tl.store(row_s_ptr + rows * (K // 32) + sk, e.to(tl.uint8), mask=(rows < M) & (sk < K // 32))


@triton.jit
def _set_amax(x, R: tl.constexpr, BK: tl.constexpr):
    """``[R/8, BK]``: max|x| over each 8 consecutive rows of a row set (one 32-row block)."""
    return tl.max(tl.reshape(tl.abs(x), (R // 8, 8, BK)), axis=1)


@triton.jit
def _col_bytes(x, inv, FMAX: tl.constexpr, E5M2: tl.constexpr, R: tl.constexpr, BK: tl.constexpr):
    """fp8 bytes (int32, 0..255) of a row set scaled by its block's ``inv [R/8, BK]``."""
    q = _to_fp8(tl.reshape(x, (R // 8, 8, BK)) * inv[:, None, :], FMAX, E5M2)
    return tl.reshape(q, (R, BK)).to(tl.uint8, bitcast=True).to(tl.int32)


@triton.jit
def _mxfp8_kernel(
    x_ptr, row_ptr, row_s_ptr, col32_ptr, col_s_ptr, M, K, stride_m,
    FMAX: tl.constexpr, E5M2: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr,
):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    R: tl.constexpr = BM // 4
    rs = pid_m * BM + tl.arange(0, R)[:, None] * 4  # first row of each group of 4
    rk = pid_k * BK + tl.arange(0, BK)[None, :]
    x0 = _load_set(x_ptr, rs, rk, M, K, stride_m)
    x1 = _load_set(x_ptr, rs + 1, rk, M, K, stride_m)
    x2 = _load_set(x_ptr, rs + 2, rk, M, K, stride_m)
    x3 = _load_set(x_ptr, rs + 3, rk, M, K, stride_m)
    if ROW:
        _rows_set(x0, rs, rk, row_ptr, row_s_ptr, pid_k, M, K, FMAX, E5M2, R, BK)
        _rows_set(x1, rs + 1, rk, row_ptr, row_s_ptr, pid_k, M, K, FMAX, E5M2, R, BK)
        _rows_set(x2, rs + 2, rk, row_ptr, row_s_ptr, pid_k, M, K, FMAX, E5M2, R, BK)
        _rows_set(x3, rs + 3, rk, row_ptr, row_s_ptr, pid_k, M, K, FMAX, E5M2, R, BK)
    if COL:  # 32×1 blocks along M; stored [K, M] as int32 words of 4 consecutive m
        amax = tl.maximum(tl.maximum(_set_amax(x0, R, BK), _set_amax(x1, R, BK)),
                          tl.maximum(_set_amax(x2, R, BK), _set_amax(x3, R, BK)))
        e = e8m0_rceil(amax, E5M2)  # [BM/32, BK]
        inv = exp2_int(127 - e)
        w = _col_bytes(x0, inv, FMAX, E5M2, R, BK)
        w |= _col_bytes(x1, inv, FMAX, E5M2, R, BK) << 8
        w |= _col_bytes(x2, inv, FMAX, E5M2, R, BK) << 16
        w |= _col_bytes(x3, inv, FMAX, E5M2, R, BK) << 24
        ck = pid_k * BK + tl.arange(0, BK)[:, None]
        cw = pid_m * R + tl.arange(0, R)[None, :]
        tl.store(col32_ptr + ck * (M // 4) + cw, tl.trans(w), mask=(ck < K) & (cw < M // 4))
        sm = pid_m * (BM // 32) + tl.arange(0, BM // 32)[None, :]
        e_t = tl.trans(e).to(tl.uint8)
        tl.store(col_s_ptr + ck * (M // 32) + sm, e_t, mask=(ck < K) & (sm < M // 32))


def _mxfp8_shapes(m, k, rowwise, columnwise):
    return [((m, k) if rowwise else (0, 0)), ((m, k // MX_BLOCK) if rowwise else (0, 0)),
            ((k, m) if columnwise else (0, 0)), ((k, m // MX_BLOCK) if columnwise else (0, 0))]


def mxfp8_quantize_tiles(x: torch.Tensor, dtype: torch.dtype, rowwise: bool, columnwise: bool,
                         config: TileConfig = MXFP8_DEFAULT):
    """Launch on ``x [M, K]`` (unit stride along K; ``M % 32 == 0`` for columnwise):
    ``(row [M,K], row_scale [M,K/32], col [K,M], col_scale [K,M/32])``; absent ones empty."""
    m, k = x.shape
    s_row, s_rs, s_col, s_cs = _mxfp8_shapes(m, k, rowwise, columnwise)
    dev = x.device
    row = torch.empty(s_row, dtype=dtype, device=dev)
    row_s = torch.empty(s_rs, dtype=torch.uint8, device=dev)
    col = torch.empty(s_col, dtype=dtype, device=dev)
    col_s = torch.empty(s_cs, dtype=torch.uint8, device=dev)
    if x.numel():
        grid = (cdiv(m, config.bm), cdiv(k, config.bk))
        col32 = col.view(torch.int32) if columnwise else torch.empty(0, dtype=torch.int32, device=dev)
        _mxfp8_kernel[grid](x, row, row_s, col32, col_s, m, k, x.stride(0),
                            FMAX=FP8_MAX[dtype], E5M2=dtype == torch.float8_e5m2, ROW=rowwise,
                            COL=columnwise, BM=config.bm, BK=config.bk, num_warps=config.num_warps)
    return row, row_s, col, col_s


@torch.library.custom_op("hybrid_dist::mxfp8_quantize", mutates_args=())
def mxfp8_quantize_op(
    x: torch.Tensor, dtype: torch.dtype, rowwise: bool, columnwise: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(row [M,K], row_scale [M,K/32], col [K,M], col_scale [K,M/32])``; absent ones empty.

    The default is the v1 kernel (``mxfp8_v1``: 0.693x of copy for row+col on an H100
    against 0.448x for the tile kernel's default config, 16384x8192, one run); the tile
    kernel runs when a ``config`` is given (tests, ``--sweep``)."""
    from hybrid_dist.kernels.mxfp8_v1 import mxfp8_quantize_v1

    return mxfp8_quantize_v1(x, dtype, rowwise, columnwise)


@mxfp8_quantize_op.register_fake
def _(x, dtype, rowwise, columnwise):
    m, k = x.shape
    s_row, s_rs, s_col, s_cs = _mxfp8_shapes(m, k, rowwise, columnwise)
    return (x.new_empty(s_row, dtype=dtype), x.new_empty(s_rs, dtype=torch.uint8),
            x.new_empty(s_col, dtype=dtype), x.new_empty(s_cs, dtype=torch.uint8))


def quantize_mxfp8(q: MXFP8Quantizer, x2d, *, rowwise, columnwise, state, amax, config: TileConfig | None = None):
    """Registry impl for :class:`MXFP8Quantizer` (bitwise the reference). ``config``: a tile
    config other than the default (eager only: tests and benchmarks).

    The fused in-register transpose is used for bf16 inputs; other inputs quantize
    ``x`` and ``x.T`` (a torch transpose) rowwise, since an 8-bit in-register transpose
    gave wrong bytes for fp32 inputs in the FP8 kernel on Triton 3.6 / H100 (the columnwise
    bytes now move as 32-bit words, but fp32 inputs are not tested on that path)."""
    kw = dict(state=state, amax=amax, config=config)
    if columnwise and x2d.dtype != torch.bfloat16:
        row_st = quantize_mxfp8(q, x2d, rowwise=True, columnwise=False, **kw)[0] if rowwise else None
        col = quantize_mxfp8(q, x2d.t().contiguous(), rowwise=True, columnwise=False, **kw)[0]
        return row_st, MXFP8Storage(data=col.data, scale=col.scale, transposed=True)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    if config is None:
        row, row_s, col, col_s = mxfp8_quantize(x2d, q.dtype, rowwise, columnwise)
    else:
        row, row_s, col, col_s = mxfp8_quantize_tiles(x2d, q.dtype, rowwise, columnwise, config)
    row_st = MXFP8Storage(data=row, scale=row_s, transposed=False) if rowwise else None
    col_st = MXFP8Storage(data=col, scale=col_s, transposed=True) if columnwise else None
    return row_st, col_st


mxfp8_quantize = eager_or_op(mxfp8_quantize_op, mxfp8_quantize_op._init_fn)
