"""FP8 block quantize (1×128 and 128×128 blocks), both directions from one tile read.

Each program owns one 128×128 tile of ``x [M, K]``:

* ``1x128``: rowwise blocks are the tile's rows (``scale_inv [M, K/128]``); columnwise
  blocks are its columns, stored transposed (``data [K, M]``, ``scale_inv [K, M/128]``);
* ``128x128``: one block per tile; columnwise is the exact transpose of rowwise
  (``scale_inv [M/128, K/128]`` and its transpose).

Scales follow ``Float8BlockQuantizer.quantize_rows``: ``scale = fp8_max / max(amax, eps)``
(1 if 0), clamped to fp32 max, power-of-two floor if asked, ``scale_inv = 1/scale``
(IEEE division): bitwise equal to the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_dist.formats.float8_block import BLOCK, Float8BlockQuantizer, Float8BlockStorage
from hybrid_dist.formats.numerics import FP8_MAX
from hybrid_dist.kernels._jit_common import cast_fp8, cdiv, div_rn, eager_or_op, per_block_scale
from hybrid_dist.kernels._launch import launch
from hybrid_dist.library_op import library_op


@triton.jit
def _fp8_block_kernel(
    x_ptr, row_ptr, row_s_ptr, col_ptr, col_s_ptr, M, K, stride_m,
    FMAX: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr, SQUARE: tl.constexpr,
    ROW: tl.constexpr, COL: tl.constexpr, B: tl.constexpr,
):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rm = pid_m * B + tl.arange(0, B)[:, None]
    rk = pid_k * B + tl.arange(0, B)[None, :]
    mask = (rm < M) & (rk < K)
    x_in = tl.load(x_ptr + rm * stride_m + rk, mask=mask, other=0.0)
    x = x_in.to(tl.float32)
    out_ty = row_ptr.dtype.element_ty if ROW else col_ptr.dtype.element_ty
    ck = pid_k * B + tl.arange(0, B)[:, None]  # columnwise stores: [K, M]
    cm = pid_m * B + tl.arange(0, B)[None, :]
    if SQUARE:
        # amax of the input dtype (exact: |x| and max commute with the widening), cheaper
        # than the fp32 reduction
        scale = per_block_scale(tl.max(tl.max(tl.abs(x_in), axis=1), axis=0).to(tl.float32), FMAX, EPS, POW2)
        q = cast_fp8(x * scale, FMAX, out_ty)
        s_inv = div_rn(tl.zeros_like(scale) + 1.0, scale)
        nk, nm = tl.cdiv(K, B), tl.cdiv(M, B)
        if ROW:
            tl.store(row_ptr + rm * K + rk, q, mask=mask)
            tl.store(row_s_ptr + pid_m * nk + pid_k, s_inv)
        if COL:  # transpose the 16-bit input and cast again (same bytes as tl.trans(q)):
            # cheaper than transposing the 8-bit codes (docs/design.md §8)
            q_t = cast_fp8(tl.trans(x_in).to(tl.float32) * scale, FMAX, out_ty)
            tl.store(col_ptr + ck * M + cm, q_t, mask=(ck < K) & (cm < M))
            tl.store(col_s_ptr + pid_k * nm + pid_m, s_inv)
    else:
        xa = tl.abs(x)
        if ROW:  # 1x128 along K: one scale per tile row
            scale = per_block_scale(tl.max(xa, axis=1), FMAX, EPS, POW2)  # [B]
            tl.store(row_ptr + rm * K + rk, cast_fp8(x * scale[:, None], FMAX, out_ty), mask=mask)
            offs = pid_m * B + tl.arange(0, B)
            tl.store(row_s_ptr + offs * tl.cdiv(K, B) + pid_k, div_rn(tl.zeros_like(scale) + 1.0, scale),
                     mask=offs < M)
        if COL:  # 128x1 along M: one scale per tile column, stored transposed
            scale = per_block_scale(tl.max(xa, axis=0), FMAX, EPS, POW2)  # [B] per k
            q_t = tl.trans(cast_fp8(x * scale[None, :], FMAX, out_ty))
            tl.store(col_ptr + ck * M + cm, q_t, mask=(ck < K) & (cm < M))
            offs = pid_k * B + tl.arange(0, B)
            tl.store(col_s_ptr + offs * tl.cdiv(M, B) + pid_m, div_rn(tl.zeros_like(scale) + 1.0, scale),
                     mask=offs < K)


_square_kernel = triton.autotune(configs=[triton.Config({}, num_warps=w) for w in (4, 8)],
                                 key=["M", "K", "ROW", "COL"])(_fp8_block_kernel)
# 1x128: one fixed launch config. The kernel is issue-bound (per-row and per-column amax and
# IEEE divisions); 4 warps capped at 168 registers fit 3 programs per SM instead of 2 at the
# 188 the compiler picks (the fastest of the caps and warp counts tried on sm_90).
_ROWS_LAUNCH = dict(num_warps=4, maxnreg=168)


@library_op("hybrid_dist::fp8_block_quantize")
def fp8_block_quantize_op(
    x: torch.Tensor, dtype: torch.dtype, square: bool, power_of_2_scales: bool, amax_epsilon: float,
    rowwise: bool, columnwise: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(row, row_scale_inv, col, col_scale_inv)`` (see module doc); absent ones empty."""
    row, row_s, col, col_s = _fp8_block_fake(x, dtype, square, rowwise, columnwise)
    m, k = x.shape
    if x.numel():
        grid = (cdiv(m, BLOCK), cdiv(k, BLOCK))
        args = (x, row, row_s, col, col_s, m, k, x.stride(0))
        consts = dict(FMAX=FP8_MAX[dtype], EPS=amax_epsilon, POW2=power_of_2_scales, ROW=rowwise, COL=columnwise,
                      B=BLOCK)
        if square:
            _square_kernel[grid](*args, SQUARE=True, **consts)  # autotuned: Triton's launch path
        else:
            launch(_fp8_block_kernel, grid, *args, SQUARE=False, **consts, **_ROWS_LAUNCH)
    return row, row_s, col, col_s


def _fp8_block_fake(x, dtype, square, rowwise, columnwise):
    m, k = x.shape
    nm, nk = -(-m // BLOCK), -(-k // BLOCK)
    row_s_shape = (nm, nk) if square else (m, nk)
    col_s_shape = (nk, nm) if square else (k, nm)
    f32 = torch.float32
    return (x.new_empty((m, k) if rowwise else (0, 0), dtype=dtype),
            x.new_empty(row_s_shape if rowwise else (0, 0), dtype=f32),
            x.new_empty((k, m) if columnwise else (0, 0), dtype=dtype),
            x.new_empty(col_s_shape if columnwise else (0, 0), dtype=f32))


@fp8_block_quantize_op.register_fake
def _(x, dtype, square, power_of_2_scales, amax_epsilon, rowwise, columnwise):
    return _fp8_block_fake(x, dtype, square, rowwise, columnwise)


def quantize_fp8_block(q: Float8BlockQuantizer, x2d, *, rowwise, columnwise, state, amax):
    """Registry impl for :class:`Float8BlockQuantizer` (bitwise the reference, from bf16, fp16
    and fp32 inputs: unlike ``fp8.tensor``'s kernel, note on fp32 inputs)."""
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    square = q.block == "128x128"
    row, row_s, col, col_s = fp8_block_quantize(
        x2d, q.dtype, square, q.power_of_2_scales, float(q.amax_epsilon), rowwise, columnwise)
    br = q.block_rows
    row_st = Float8BlockStorage(data=row, scale_inv=row_s, block_rows=br, transposed=False) if rowwise else None
    col_st = Float8BlockStorage(data=col, scale_inv=col_s, block_rows=br, transposed=True) if columnwise else None
    return row_st, col_st


fp8_block_quantize = eager_or_op(fp8_block_quantize_op, fp8_block_quantize_op.fn)
