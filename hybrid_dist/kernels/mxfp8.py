"""MXFP8 fused quantize: one read of an ``[BM, BK]`` tile makes both directions.

Rowwise: 1×32 blocks along K → ``data [M, K]``, ``scale [M, K/32]`` (uint8 E8M0).
Columnwise: 32×1 blocks along M, stored transposed → ``data [K, M]``, ``scale [K, M/32]``.
Per block ``e = RCEIL(amax / fp8_max)``, ``q = sat(x · 2**(127-e))`` — the same IEEE
operations as ``formats.mxfp8.mxfp8_quantize_rows``, so the result is bitwise equal.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_dist.formats._numerics import FP8_MAX
from hybrid_dist.formats.mxfp8 import MX_BLOCK, MXFP8Quantizer, MXFP8Storage
from hybrid_dist.kernels._jit_common import cdiv, eager_or_op, cast_fp8, e8m0_from_amax, exp2_int

_CONFIGS = [triton.Config({"BM": bm, "BK": bk}, num_warps=w)
            for bm, bk, w in ((64, 64, 4), (32, 128, 4), (64, 128, 4), (64, 128, 8), (128, 64, 8))]


@triton.autotune(configs=_CONFIGS, key=["M", "K", "ROW", "COL"])
@triton.jit
def _mxfp8_kernel(
    x_ptr, row_ptr, row_s_ptr, col_ptr, col_s_ptr, M, K, stride_m,
    FMAX: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)[:, None]
    rk = pid_k * BK + tl.arange(0, BK)[None, :]
    mask = (rm < M) & (rk < K)
    x = tl.load(x_ptr + rm * stride_m + rk, mask=mask, other=0.0).to(tl.float32)
    if ROW:
        blocks = tl.reshape(x, (BM, BK // 32, 32))
        e = e8m0_from_amax(tl.max(tl.abs(blocks), axis=2), FMAX)  # [BM, BK/32]
        inv = exp2_int(127 - e)
        q = cast_fp8(blocks * inv[:, :, None], FMAX, row_ptr.dtype.element_ty)
        tl.store(row_ptr + rm * K + rk, tl.reshape(q, (BM, BK)), mask=mask)
        sk = pid_k * (BK // 32) + tl.arange(0, BK // 32)[None, :]
        tl.store(row_s_ptr + rm * (K // 32) + sk, e.to(tl.uint8), mask=(rm < M) & (sk < K // 32))
    if COL:  # blocks of 32 along M, computed in x's orientation, stored transposed
        ck = pid_k * BK + tl.arange(0, BK)[:, None]
        cm = pid_m * BM + tl.arange(0, BM)[None, :]
        blocks = tl.reshape(x, (BM // 32, 32, BK))
        e = e8m0_from_amax(tl.max(tl.abs(blocks), axis=1), FMAX)  # [BM/32, BK]
        inv = exp2_int(127 - e)
        q = cast_fp8(blocks * inv[:, None, :], FMAX, col_ptr.dtype.element_ty)
        q_t = tl.trans(tl.reshape(q, (BM, BK)))
        tl.store(col_ptr + ck * M + cm, q_t, mask=(ck < K) & (cm < M))
        sm = pid_m * (BM // 32) + tl.arange(0, BM // 32)[None, :]
        tl.store(col_s_ptr + ck * (M // 32) + sm, tl.trans(e).to(tl.uint8), mask=(ck < K) & (sm < M // 32))


@torch.library.custom_op("hybrid_dist::mxfp8_quantize", mutates_args=())
def mxfp8_quantize_op(
    x: torch.Tensor, dtype: torch.dtype, rowwise: bool, columnwise: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(row [M,K], row_scale [M,K/32], col [K,M], col_scale [K,M/32])``; absent ones empty."""
    m, k = x.shape
    dev = x.device
    row = torch.empty((m, k) if rowwise else (0, 0), dtype=dtype, device=dev)
    row_s = torch.empty((m, k // MX_BLOCK) if rowwise else (0, 0), dtype=torch.uint8, device=dev)
    col = torch.empty((k, m) if columnwise else (0, 0), dtype=dtype, device=dev)
    col_s = torch.empty((k, m // MX_BLOCK) if columnwise else (0, 0), dtype=torch.uint8, device=dev)
    if x.numel():
        grid = lambda meta: (cdiv(m, meta["BM"]), cdiv(k, meta["BK"]))  # noqa: E731
        _mxfp8_kernel[grid](x, row, row_s, col, col_s, m, k, x.stride(0), FMAX=FP8_MAX[dtype],
                            ROW=rowwise, COL=columnwise)
    return row, row_s, col, col_s


@mxfp8_quantize_op.register_fake
def _(x, dtype, rowwise, columnwise):
    m, k = x.shape
    return (x.new_empty((m, k) if rowwise else (0, 0), dtype=dtype),
            x.new_empty((m, k // MX_BLOCK) if rowwise else (0, 0), dtype=torch.uint8),
            x.new_empty((k, m) if columnwise else (0, 0), dtype=dtype),
            x.new_empty((k, m // MX_BLOCK) if columnwise else (0, 0), dtype=torch.uint8))


def quantize_mxfp8(q: MXFP8Quantizer, x2d, *, rowwise, columnwise, state, amax):
    """Registry impl for :class:`MXFP8Quantizer` (bitwise the reference).

    The fused in-register transpose is used for bf16 inputs; other inputs quantize
    ``x`` and ``x.T`` (a torch transpose) rowwise, since an 8-bit in-register transpose
    gave wrong bytes for fp32 inputs in the FP8 kernel on Triton 3.6 / H100."""
    if columnwise and x2d.dtype != torch.bfloat16:
        row_st = quantize_mxfp8(q, x2d, rowwise=True, columnwise=False, state=state, amax=amax)[0] if rowwise else None
        col = quantize_mxfp8(q, x2d.t().contiguous(), rowwise=True, columnwise=False, state=state, amax=amax)[0]
        return row_st, MXFP8Storage(data=col.data, scale=col.scale, transposed=True)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    row, row_s, col, col_s = mxfp8_quantize(x2d, q.dtype, rowwise, columnwise)
    row_st = MXFP8Storage(data=row, scale=row_s, transposed=False) if rowwise else None
    col_st = MXFP8Storage(data=col, scale=col_s, transposed=True) if columnwise else None
    return row_st, col_st


mxfp8_quantize = eager_or_op(mxfp8_quantize_op, mxfp8_quantize_op._init_fn)
