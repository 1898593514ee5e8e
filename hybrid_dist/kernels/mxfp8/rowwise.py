"""MXFP8 quantize of one ``[BM, BK]`` tile per program: the fast path for rowwise only
(``mxfp8.quantize.mxfp8_quantize_op`` dispatches there; with a columnwise direction the
32-row-set kernel of ``mxfp8.quantize`` is faster). ``benchmarks/quantize.py --fast-paths``
times it against that kernel.

Layout (``formats.mxfp8``): rowwise ``data [M, K]`` + E8M0 ``scale [M, K/32]``; columnwise,
when asked (an 8-bit in-register transpose of the tile), ``data [K, M]`` + ``[K, M/32]``.
One fixed tile, ``32x256`` with 4 warps (no autotuning: deterministic, and no benchmarking
at the first call). The E8M0 exponent is the integer-only RCEIL of
``_jit_common.e8m0_rceil`` (no fp32 division).

Guarantee: bitwise ``formats.mxfp8.mxfp8_quantize_rows`` in each direction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_dist.formats.numerics import FP8_MAX
from hybrid_dist.formats.mxfp8 import MX_BLOCK
from hybrid_dist.kernels._jit_common import cdiv, cast_fp8, e8m0_rceil, exp2_int

_BM, _BK, _WARPS = 32, 256, 4


@triton.jit
def _mxfp8_kernel(
    x_ptr, row_ptr, row_s_ptr, col_ptr, col_s_ptr, M, K, stride_m,
    FMAX: tl.constexpr, E5M2: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr, BM: tl.constexpr,
    BK: tl.constexpr,
):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)[:, None]
    rk = pid_k * BK + tl.arange(0, BK)[None, :]
    mask = (rm < M) & (rk < K)
    x = tl.load(x_ptr + rm * stride_m + rk, mask=mask, other=0.0).to(tl.float32)
    if ROW:
        blocks = tl.reshape(x, (BM, BK // 32, 32))
        e = e8m0_rceil(tl.max(tl.abs(blocks), axis=2), E5M2)  # [BM, BK/32]
        inv = exp2_int(127 - e)
        q = cast_fp8(blocks * inv[:, :, None], FMAX, row_ptr.dtype.element_ty)
        tl.store(row_ptr + rm * K + rk, tl.reshape(q, (BM, BK)), mask=mask)
        sk = pid_k * (BK // 32) + tl.arange(0, BK // 32)[None, :]
        tl.store(row_s_ptr + rm * (K // 32) + sk, e.to(tl.uint8), mask=(rm < M) & (sk < K // 32))
    if COL:  # blocks of 32 along M, computed in x's orientation, stored transposed
        ck = pid_k * BK + tl.arange(0, BK)[:, None]
        cm = pid_m * BM + tl.arange(0, BM)[None, :]
        blocks = tl.reshape(x, (BM // 32, 32, BK))
        e = e8m0_rceil(tl.max(tl.abs(blocks), axis=1), E5M2)  # [BM/32, BK]
        inv = exp2_int(127 - e)
        q = cast_fp8(blocks * inv[:, None, :], FMAX, col_ptr.dtype.element_ty)
        q_t = tl.trans(tl.reshape(q, (BM, BK)))
        tl.store(col_ptr + ck * M + cm, q_t, mask=(ck < K) & (cm < M))
        sm = pid_m * (BM // 32) + tl.arange(0, BM // 32)[None, :]
        tl.store(col_s_ptr + ck * (M // 32) + sm, tl.trans(e).to(tl.uint8), mask=(ck < K) & (sm < M // 32))



def mxfp8_quantize_rowwise(x: torch.Tensor, dtype: torch.dtype, rowwise: bool, columnwise: bool):
    """``(row [M,K], row_scale [M,K/32], col [K,M], col_scale [K,M/32])``; absent ones empty."""
    m, k = x.shape
    dev = x.device
    row = torch.empty((m, k) if rowwise else (0, 0), dtype=dtype, device=dev)
    row_s = torch.empty((m, k // MX_BLOCK) if rowwise else (0, 0), dtype=torch.uint8, device=dev)
    col = torch.empty((k, m) if columnwise else (0, 0), dtype=dtype, device=dev)
    col_s = torch.empty((k, m // MX_BLOCK) if columnwise else (0, 0), dtype=torch.uint8, device=dev)
    if x.numel():
        _mxfp8_kernel[(cdiv(m, _BM), cdiv(k, _BK))](
            x, row, row_s, col, col_s, m, k, x.stride(0), FMAX=FP8_MAX[dtype], E5M2=dtype == torch.float8_e5m2,
            ROW=rowwise, COL=columnwise, BM=_BM, BK=_BK, num_warps=_WARPS)
    return row, row_s, col, col_s
