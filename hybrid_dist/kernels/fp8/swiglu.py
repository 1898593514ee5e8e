"""Fused SwiGLU → FP8 (per-tensor current scaling): ``y = silu(a) * b [M, K]`` quantized
without writing ``y`` in bf16 (``hd.SwiGLU`` linked to its consumer; see
``hybrid_dist.shared_input``).

Two passes, as ``fp8.tensor``'s amax + cast, each recomputing ``y`` per ``[BM, BK]`` tile:

1. ``_amax_kernel``: ``max|y|`` into an fp32 scalar (tiles + relaxed atomic max);
2. ``_cast_kernel``: scale from that amax (``per_block_scale``, as ``Float8Quantizer``),
   writes the rowwise ``[M, K]`` fp8 data; program (0, 0) writes ``scale_inv = 1 / scale``.
   The columnwise ``[K, M]`` data is ``kernels.transpose`` of it (an in-register
   transpose gives wrong columnwise bytes with Triton 3.6 on sm_90: ``docs/design.md`` §8).

``y`` is bitwise torch's formula (``hybrid_dist.activation``) for bf16 ``a``, ``b``:
``h = bf16(a / (1 + expf(-a)))`` (torch's CUDA ``silu``: ``expf`` is libdevice's, the
division IEEE ``div_rn``), ``y = bf16(h · b)`` (the product of two bf16 values is exact in
fp32; one rounding, as torch). Other dtypes get ``NotImplemented`` (the producer then
computes the formula and quantizes it with ``quantize_storages``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from hybrid_dist.formats.float8 import Float8Quantizer, Float8Storage
from hybrid_dist.formats.numerics import FP8_MAX
from hybrid_dist.kernels._jit_common import INTERPRET, cast_fp8, cdiv, div_rn, eager_or_op, per_block_scale, round_bf16
from hybrid_dist.kernels._launch import launch
from hybrid_dist.kernels._zeros import fresh_f32, zeroed_f32
from hybrid_dist.kernels.transpose import transposed
from hybrid_dist.library_op import library_op

_BM, _BK = 64, 128


@triton.jit
def _swiglu_tile(a_ptr, b_ptr, rm, rk, M, K, stride_a, stride_b, LIBDEVICE: tl.constexpr):
    """``y`` (fp32 holding bf16 values) of tile ``rm x rk``; 0 outside ``[M, K]``."""
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
def _amax_kernel(a_ptr, b_ptr, amax_ptr, M, K, sa, sb, BM: tl.constexpr, BK: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)[:, None]
    rk = tl.program_id(1) * BK + tl.arange(0, BK)[None, :]
    y = _swiglu_tile(a_ptr, b_ptr, rm, rk, M, K, sa, sb, not INTERPRET)
    tl.atomic_max(amax_ptr, sem="relaxed", val=tl.max(tl.abs(y)))


@triton.jit
def _cast_kernel(a_ptr, b_ptr, amax_ptr, scale_inv_ptr, row_ptr, M, K, sa, sb, FMAX: tl.constexpr,
                 EPS: tl.constexpr, POW2: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)[:, None]
    rk = pid_k * BK + tl.arange(0, BK)[None, :]
    y = _swiglu_tile(a_ptr, b_ptr, rm, rk, M, K, sa, sb, not INTERPRET)
    scale = per_block_scale(tl.load(amax_ptr), FMAX, EPS, POW2)
    if (pid_m == 0) & (pid_k == 0):
        tl.store(scale_inv_ptr, div_rn(tl.zeros_like(scale) + 1.0, scale))
    q = cast_fp8(y * scale, FMAX, row_ptr.dtype.element_ty)
    tl.store(row_ptr + rm * K + rk, q, mask=(rm < M) & (rk < K))


def _swiglu_fp8(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, eps: float, pow2: bool, rowwise: bool,
                columnwise: bool, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``silu(a) * b`` of bf16 ``a, b [M, K]`` (unit stride along K), quantized:
    ``(row [M, K] or empty, col [K, M] or empty, scale_inv [])``. ``amax``: the fp32 zero the
    amax pass reduces into (default a zeroed slot; the op passes ``fresh_f32``: see
    ``kernels._zeros``)."""
    m, k = a.shape
    dev = a.device
    amax = zeroed_f32(dev) if amax is None else amax
    row = torch.empty((m, k), dtype=dtype, device=dev)
    scale_inv = torch.empty((), dtype=torch.float32, device=dev)
    grid = (max(cdiv(m, _BM), 1), max(cdiv(k, _BK), 1))
    sa, sb = max(a.stride(0), 1), max(b.stride(0), 1)
    if m and k:
        launch(_amax_kernel, grid, a, b, amax, m, k, sa, sb, BM=_BM, BK=_BK, num_warps=4)
    launch(_cast_kernel, grid, a, b, amax, scale_inv, row, m, k, sa, sb, FMAX=FP8_MAX[dtype], EPS=eps, POW2=pow2,
           BM=_BM, BK=_BK, num_warps=8)
    col = transposed(row) if columnwise else row.new_empty((0, 0))
    return (row if rowwise else row.new_empty((0, 0))), col, scale_inv


def _fake(a, b, dtype, eps, pow2, rowwise, columnwise):
    m, k = a.shape
    return (a.new_empty((m, k) if rowwise else (0, 0), dtype=dtype),
            a.new_empty((k, m) if columnwise else (0, 0), dtype=dtype), a.new_empty((), dtype=torch.float32))


def _swiglu_fp8_fresh(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, eps: float, pow2: bool, rowwise: bool,
                      columnwise: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _swiglu_fp8(a, b, dtype, eps, pow2, rowwise, columnwise, fresh_f32(a.device))


swiglu_op = library_op("hybrid_dist::swiglu_fp8")(_swiglu_fp8_fresh)
swiglu_op.register_fake(_fake)
swiglu_fp8 = eager_or_op(swiglu_op, _swiglu_fp8)


def swiglu_quantize_fp8(q: Float8Quantizer, a2d, b2d, *, rowwise, columnwise):
    """Registry impl (``"swiglu"``, :class:`Float8Quantizer`): bitwise ``quantize_storages``
    of ``F.silu(a) * b``; ``NotImplemented`` unless current scaling and bf16 ``a``, ``b``
    with unit stride along K."""
    if q.scaling != "current" or any(t.dtype != torch.bfloat16 or t.stride(-1) != 1 for t in (a2d, b2d)):
        return NotImplemented
    row, col, scale_inv = swiglu_fp8(a2d, b2d, q.dtype, float(q.amax_epsilon), q.power_of_2_scales,
                                     rowwise, columnwise)
    return (Float8Storage(data=row, scale_inv=scale_inv, transposed=False) if rowwise else None,
            Float8Storage(data=col, scale_inv=scale_inv, transposed=True) if columnwise else None)
