"""Fused RMSNorm → FP8 and SwiGLU → FP8 (per-tensor current scaling): the producer's
bf16 output ``y [M, K]`` is never written (``hd.RMSNorm`` / ``hd.SwiGLU`` linked to their
consumers; see ``hybrid_dist.shared_input``).

Two passes, as ``fp8_tensor``'s amax + cast-transpose, each recomputing ``y`` per tile:

1. ``_amax_kernel``: ``max|y|`` into an fp32 scalar (tiles + relaxed atomic max);
2. ``_cast_kernel``: scale from that amax (``per_block_scale``, as ``Float8Quantizer``),
   writes the rowwise ``[M, K]`` and/or columnwise ``[K, M]`` (transposed) fp8 data;
   program (0, 0) writes ``scale_inv = 1 / scale``. (SwiGLU: columnwise through
   ``kernels.transpose`` of the rowwise data; see ``_launch``.)

``y`` is bitwise the torch formula (``hybrid_dist.norm`` / ``hybrid_dist.activation``):

* RMSNorm, ``x`` bf16, ``rstd [M]`` fp32 from the same torch reduction as the reference
  (``rms_norm_rstd``), ``w`` bf16 or fp32: ``y = bf16(bf16(x · rstd) · w)`` — the product
  of two bf16 values is exact in fp32, one rounding each, as torch.
* SwiGLU, ``a``, ``b`` bf16: ``h = bf16(a / (1 + expf(-a)))`` (torch's CUDA ``silu``:
  ``expf`` is libdevice's, the division IEEE ``div_rn``), ``y = bf16(h · b)``.

Only bf16 inputs take these kernels (the registry impls return ``NotImplemented``
otherwise, and the producer falls back to torch + ``quantize_storages``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from hybrid_dist.formats._numerics import FP8_MAX
from hybrid_dist.formats.float8 import Float8Quantizer, Float8Storage
from hybrid_dist.kernels._jit_common import cast_fp8, cdiv, div_rn, eager_or_op, per_block_scale, round_bf16
from hybrid_dist.kernels.transpose import transposed

_BM, _BK = 64, 128
RMS_NORM, SWIGLU = 0, 1  # the OP constexpr
INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")  # read once, when kernels are defined


@triton.jit
def _rms_norm_tile(x_ptr, rstd_ptr, w_ptr, rm, rk, M, K, stride_x):
    mask = (rm < M) & (rk < K)
    x = tl.load(x_ptr + rm * stride_x + rk, mask=mask, other=0.0)
    rstd = tl.load(rstd_ptr + rm, mask=rm < M, other=0.0)
    w = tl.load(w_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
    xn = round_bf16(x.to(tl.float32) * rstd)
    return round_bf16(xn * w)


@triton.jit
def _swiglu_tile(a_ptr, b_ptr, rm, rk, M, K, stride_a, stride_b, LIBDEVICE: tl.constexpr):
    mask = (rm < M) & (rk < K)
    a = tl.load(a_ptr + rm * stride_a + rk, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + rm * stride_b + rk, mask=mask, other=0.0).to(tl.float32)
    if LIBDEVICE:  # expf as torch's CUDA silu computes it
        e = libdevice.exp(-a)
    else:  # the Triton interpreter has no libdevice
        e = tl.exp(-a)
    h = round_bf16(div_rn(a, 1.0 + e))
    return round_bf16(h * b)


@triton.jit
def _tile(p0, p1, p2, rm, rk, M, K, s0, s1, OP: tl.constexpr):
    """``y`` (fp32 holding bf16 values) of tile ``rm x rk``; 0 outside ``[M, K]``."""
    if OP == 0:
        y = _rms_norm_tile(p0, p1, p2, rm, rk, M, K, s0)
    else:
        y = _swiglu_tile(p0, p1, rm, rk, M, K, s0, s1, not INTERPRET)
    return y


@triton.jit
def _amax_kernel(p0, p1, p2, amax_ptr, M, K, s0, s1, OP: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)[:, None]
    rk = tl.program_id(1) * BK + tl.arange(0, BK)[None, :]
    y = _tile(p0, p1, p2, rm, rk, M, K, s0, s1, OP)
    tl.atomic_max(amax_ptr, sem="relaxed", val=tl.max(tl.abs(y)))


@triton.jit
def _cast_kernel(
    p0, p1, p2, amax_ptr, scale_inv_ptr, row_ptr, col_ptr, M, K, s0, s1, OP: tl.constexpr,
    FMAX: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr,
):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)[:, None]
    rk = pid_k * BK + tl.arange(0, BK)[None, :]
    y = _tile(p0, p1, p2, rm, rk, M, K, s0, s1, OP)
    scale = per_block_scale(tl.load(amax_ptr), FMAX, EPS, POW2)
    if (pid_m == 0) & (pid_k == 0):
        tl.store(scale_inv_ptr, div_rn(tl.zeros_like(scale) + 1.0, scale))
    out_ty = row_ptr.dtype.element_ty if ROW else col_ptr.dtype.element_ty
    q = cast_fp8(y * scale, FMAX, out_ty)
    if ROW:
        tl.store(row_ptr + rm * K + rk, q, mask=(rm < M) & (rk < K))
    if COL:  # columnwise stored [K, M]: element (m, k) goes to col[k, m]
        rm_t = pid_m * BM + tl.arange(0, BM)[None, :]
        rk_t = pid_k * BK + tl.arange(0, BK)[:, None]
        tl.store(col_ptr + rk_t * M + rm_t, tl.trans(q), mask=(rk_t < K) & (rm_t < M))


def _launch(op: int, p0, p1, p2, s0: int, s1: int, m: int, k: int, dtype: torch.dtype, eps: float, pow2: bool,
            rowwise: bool, columnwise: bool):
    """``(row [M, K] or empty, col [K, M] or empty, scale_inv [])`` of the producer's ``y``."""
    dev = p0.device
    # SwiGLU: the in-register transpose gave wrong columnwise bytes on H200 (Triton 3.6; the
    # rowwise bytes were right, transposing the fp32 tile instead did not help; cause not
    # established), so the kernel writes rowwise and the transpose kernel makes columnwise
    col_in_kernel = op == RMS_NORM
    row_in_kernel = rowwise or (columnwise and not col_in_kernel)
    amax = torch.zeros((), dtype=torch.float32, device=dev)
    row = torch.empty((m, k) if row_in_kernel else (0, 0), dtype=dtype, device=dev)
    col = torch.empty((k, m) if columnwise and col_in_kernel else (0, 0), dtype=dtype, device=dev)
    scale_inv = torch.empty((), dtype=torch.float32, device=dev)
    grid = (max(cdiv(m, _BM), 1), max(cdiv(k, _BK), 1))
    if m and k:
        _amax_kernel[grid](p0, p1, p2, amax, m, k, s0, s1, OP=op, BM=_BM, BK=_BK, num_warps=4)
    _cast_kernel[grid](p0, p1, p2, amax, scale_inv, row, col, m, k, s0, s1, OP=op, FMAX=FP8_MAX[dtype], EPS=eps,
                       POW2=pow2, ROW=row_in_kernel, COL=columnwise and col_in_kernel, BM=_BM, BK=_BK, num_warps=8)
    if columnwise and not col_in_kernel:
        col = transposed(row)
        row = row if rowwise else row.new_empty((0, 0))
    return row, col, scale_inv


def _rms_norm_fp8(x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, eps: float,
                  pow2: bool, rowwise: bool, columnwise: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMSNorm of bf16 ``x [M, K]`` (unit stride along K) with ``rstd [M]`` fp32 and
    ``weight [K]``, quantized: ``(row, col, scale_inv)``."""
    m, k = x.shape
    return _launch(RMS_NORM, x, rstd, weight, max(x.stride(0), 1), 0, m, k, dtype, eps, pow2, rowwise, columnwise)


def _swiglu_fp8(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, eps: float, pow2: bool, rowwise: bool,
                columnwise: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``silu(a) * b`` of bf16 ``a, b [M, K]`` (unit stride along K), quantized."""
    m, k = a.shape
    return _launch(SWIGLU, a, b, a, max(a.stride(0), 1), max(b.stride(0), 1), m, k, dtype, eps, pow2, rowwise,
                   columnwise)


def _fake(x, dtype, rowwise, columnwise):
    m, k = x.shape
    return (x.new_empty((m, k) if rowwise else (0, 0), dtype=dtype),
            x.new_empty((k, m) if columnwise else (0, 0), dtype=dtype), x.new_empty((), dtype=torch.float32))


rms_norm_op = torch.library.custom_op("hybrid_dist::rms_norm_fp8", mutates_args=())(_rms_norm_fp8)
rms_norm_op.register_fake(lambda x, rstd, weight, dtype, eps, pow2, rw, cw: _fake(x, dtype, rw, cw))
rms_norm_fp8 = eager_or_op(rms_norm_op, _rms_norm_fp8)
swiglu_op = torch.library.custom_op("hybrid_dist::swiglu_fp8", mutates_args=())(_swiglu_fp8)
swiglu_op.register_fake(lambda a, b, dtype, eps, pow2, rw, cw: _fake(a, dtype, rw, cw))
swiglu_fp8 = eager_or_op(swiglu_op, _swiglu_fp8)


def _storages(q: Float8Quantizer, out, rowwise: bool, columnwise: bool):
    row, col, scale_inv = out
    return (Float8Storage(data=row, scale_inv=scale_inv, transposed=False) if rowwise else None,
            Float8Storage(data=col, scale_inv=scale_inv, transposed=True) if columnwise else None)


def _served(q: Float8Quantizer, *tensors: torch.Tensor) -> bool:
    return q.scaling == "current" and all(t.dtype == torch.bfloat16 and t.stride(-1) == 1 for t in tensors)


def rms_norm_quantize_fp8(q: Float8Quantizer, x2d, rstd, weight, *, rowwise, columnwise):
    """Registry impl (``"rms_norm"``, :class:`Float8Quantizer`): bitwise ``quantize_storages``
    of ``rms_norm_apply(x, rstd, weight)``; ``NotImplemented`` unless current scaling,
    bf16 ``x`` and a bf16/fp32 contiguous ``weight``."""
    if not _served(q, x2d) or weight.dtype not in (torch.bfloat16, torch.float32) or not weight.is_contiguous():
        return NotImplemented
    out = rms_norm_fp8(x2d, rstd.contiguous(), weight, q.dtype, float(q.amax_epsilon), q.power_of_2_scales,
                       rowwise, columnwise)
    return _storages(q, out, rowwise, columnwise)


def swiglu_quantize_fp8(q: Float8Quantizer, a2d, b2d, *, rowwise, columnwise):
    """Registry impl (``"swiglu"``, :class:`Float8Quantizer`): bitwise ``quantize_storages``
    of ``F.silu(a) * b``; ``NotImplemented`` unless current scaling and bf16 ``a``, ``b``."""
    if not _served(q, a2d, b2d):
        return NotImplemented
    out = swiglu_fp8(a2d, b2d, q.dtype, float(q.amax_epsilon), q.power_of_2_scales, rowwise, columnwise)
    return _storages(q, out, rowwise, columnwise)
