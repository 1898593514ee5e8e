"""Per-tensor FP8 (current / delayed scaling): amax pass + one fused cast-transpose pass.

Kernels (``torch.library`` ops in the ``hybrid_dist`` namespace):

* ``hybrid_dist::amax``: fp32 ``max|x|`` of a 2D tensor (grid-stride tiles + atomic max).
* ``hybrid_dist::fp8_cast_transpose``: reads ``x [M, K]`` once and writes the rowwise
  ``[M, K]`` and/or columnwise ``[K, M]`` (its transpose) fp8 data with one fp32 ``scale``
  (``sat(x · scale)``, round to nearest even — bitwise ``Float8Quantizer._quantize_2d``).
  With ``with_amax`` it also returns ``max|x|`` from the same pass (delayed scaling).

The scale itself (``fp8_max / amax``, delayed history, ``1/scale``) is computed by the
reference quantizer's own torch code on the device (a handful of scalar ops).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_dist.formats._numerics import FP8_MAX
from hybrid_dist.formats.float8 import DelayedScalingState, Float8Quantizer, Float8Storage
from hybrid_dist.kernels._jit_common import cast_fp8

_BM, _BK = 64, 128


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, M, K, stride_m, BM: tl.constexpr, BK: tl.constexpr):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)[:, None]
    rk = pid_k * BK + tl.arange(0, BK)[None, :]
    x = tl.load(x_ptr + rm * stride_m + rk, mask=(rm < M) & (rk < K), other=0.0)
    tl.atomic_max(amax_ptr, tl.max(tl.abs(x.to(tl.float32))))


@triton.jit
def _cast_transpose_kernel(
    x_ptr, scale_ptr, row_ptr, col_ptr, amax_ptr, M, K, stride_m,
    FMAX: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr, AMAX: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr,
):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)[:, None]
    rk = pid_k * BK + tl.arange(0, BK)[None, :]
    mask = (rm < M) & (rk < K)
    x = tl.load(x_ptr + rm * stride_m + rk, mask=mask, other=0.0).to(tl.float32)
    if AMAX:
        tl.atomic_max(amax_ptr, tl.max(tl.abs(x)))
    scale = tl.load(scale_ptr)
    out_ty = row_ptr.dtype.element_ty if ROW else col_ptr.dtype.element_ty
    q = cast_fp8(x * scale, FMAX, out_ty)
    if ROW:
        tl.store(row_ptr + rm * K + rk, q, mask=mask)
    if COL:
        # columnwise stored [K, M]: element (m, k) goes to col[k, m]
        rm_t = pid_m * BM + tl.arange(0, BM)[None, :]
        rk_t = pid_k * BK + tl.arange(0, BK)[:, None]
        tl.store(col_ptr + rk_t * M + rm_t, tl.trans(q), mask=(rk_t < K) & (rm_t < M))


@torch.library.custom_op("hybrid_dist::amax", mutates_args=())
def amax_2d(x: torch.Tensor) -> torch.Tensor:
    """fp32 scalar ``max|x|`` of a 2D tensor with unit stride along dim 1."""
    m, k = x.shape
    out = torch.zeros((), dtype=torch.float32, device=x.device)
    if x.numel():
        grid = (triton.cdiv(m, _BM), triton.cdiv(k, _BK))
        _amax_kernel[grid](x, out, m, k, x.stride(0), BM=_BM, BK=_BK, num_warps=4)
    return out


@amax_2d.register_fake
def _(x):
    return x.new_empty((), dtype=torch.float32)


@torch.library.custom_op("hybrid_dist::fp8_cast_transpose", mutates_args=())
def fp8_cast_transpose(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, rowwise: bool, columnwise: bool,
    with_amax: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(row [M, K] or empty, col [K, M] or empty, amax [] )`` fp8 of ``x · scale``."""
    m, k = x.shape
    row = torch.empty((m, k) if rowwise else (0, 0), dtype=dtype, device=x.device)
    col = torch.empty((k, m) if columnwise else (0, 0), dtype=dtype, device=x.device)
    amax_out = torch.zeros((), dtype=torch.float32, device=x.device)
    if x.numel():
        grid = (triton.cdiv(m, _BM), triton.cdiv(k, _BK))
        _cast_transpose_kernel[grid](
            x, scale, row, col, amax_out, m, k, x.stride(0), FMAX=FP8_MAX[dtype],
            ROW=rowwise, COL=columnwise, AMAX=with_amax, BM=_BM, BK=_BK, num_warps=8,
        )
    return row, col, amax_out


@fp8_cast_transpose.register_fake
def _(x, scale, dtype, rowwise, columnwise, with_amax):
    m, k = x.shape
    return (x.new_empty((m, k) if rowwise else (0, 0), dtype=dtype),
            x.new_empty((k, m) if columnwise else (0, 0), dtype=dtype),
            x.new_empty((), dtype=torch.float32))


def quantize_fp8_tensor(q: Float8Quantizer, x2d, *, rowwise, columnwise, state, amax):
    """Registry impl for :class:`Float8Quantizer` (bitwise the reference)."""
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    if q.scaling == "delayed" and amax is None:
        if not isinstance(state, DelayedScalingState):
            return NotImplemented  # the reference raises the explanatory ValueError
        scale = state.to(x2d.device).scale.clone()
        row, col, seen = fp8_cast_transpose(x2d, scale, q.dtype, rowwise, columnwise, True)
        state.record(seen)
    else:
        if amax is None and q.scaling == "current":
            amax = amax_2d(x2d)
        scale = q.compute_scale(x2d, state, amax)
        row, col, _ = fp8_cast_transpose(x2d, scale, q.dtype, rowwise, columnwise, False)
    scale_inv = torch.reciprocal(scale)
    row_st = Float8Storage(data=row, scale_inv=scale_inv, transposed=False) if rowwise else None
    col_st = Float8Storage(data=col, scale_inv=scale_inv, transposed=True) if columnwise else None
    return row_st, col_st
