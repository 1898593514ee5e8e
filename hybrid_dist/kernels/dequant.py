"""Bandwidth-bound dequantize-to-bf16 kernels (the GEMM operand path of block formats).

Each kernel turns one stored direction ``[R, C]`` into bf16 ``[R, C]`` with its block
scales applied and its per-tensor scale **not** applied (that goes on the fp32
accumulator). The products are exact in bf16: E4M3 × 2**k (MXFP8, k in E8M0 range of
normal bf16) and E2M1 × E4M3 (NVFP4: at most 5 significant bits). ``scale_cast``
applies per-tensor scales to an fp32 accumulator and casts, in the reference's order
(``(acc · s_a) · s_b``, then one rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_dist.kernels._jit_common import cdiv, e2m1_decode, eager_or_op, exp2_int
from hybrid_dist.kernels._launch import launch
from hybrid_dist.library_op import library_op

_BR, _BC = 64, 128


@triton.jit
def _mxfp8_dequant_kernel(d_ptr, s_ptr, out_ptr, R, C, BR: tl.constexpr, BC: tl.constexpr):
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rr = pid_r * BR + tl.arange(0, BR)[:, None]
    rc = pid_c * BC + tl.arange(0, BC)[None, :]
    mask = (rr < R) & (rc < C)
    q = tl.load(d_ptr + rr * C + rc, mask=mask, other=0.0).to(tl.float32)
    sc = pid_c * (BC // 32) + tl.arange(0, BC // 32)[None, :]
    e = tl.load(s_ptr + rr * (C // 32) + sc, mask=(rr < R) & (sc < C // 32), other=127).to(tl.int32)
    v = tl.reshape(q, (BR, BC // 32, 32)) * exp2_int(e - 127)[:, :, None]
    tl.store(out_ptr + rr * C + rc, tl.reshape(v, (BR, BC)).to(tl.bfloat16), mask=mask)


@triton.jit
def _nvfp4_dequant_kernel(d_ptr, s_ptr, out_ptr, R, C, BLOCK_ROWS: tl.constexpr,
                          BR: tl.constexpr, BC: tl.constexpr):
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rr = pid_r * BR + tl.arange(0, BR)[:, None]
    pc = pid_c * (BC // 2) + tl.arange(0, BC // 2)[None, :]
    packed = tl.load(d_ptr + rr * (C // 2) + pc, mask=(rr < R) & (pc < C // 2), other=0).to(tl.int32)
    v = tl.reshape(tl.join(e2m1_decode(packed & 0xF), e2m1_decode(packed >> 4)), (BR, BC))
    sr = pid_r * (BR // BLOCK_ROWS) + tl.arange(0, BR // BLOCK_ROWS)[:, None]
    sc = pid_c * (BC // 16) + tl.arange(0, BC // 16)[None, :]
    s = tl.load(s_ptr + sr * (C // 16) + sc, mask=(sr < R // BLOCK_ROWS) & (sc < C // 16), other=0.0)
    v = tl.reshape(v, (BR // BLOCK_ROWS, BLOCK_ROWS, BC // 16, 16)) * s.to(tl.float32)[:, None, :, None]
    rc = pid_c * BC + tl.arange(0, BC)[None, :]
    tl.store(out_ptr + rr * C + rc, tl.reshape(v, (BR, BC)).to(tl.bfloat16), mask=(rr < R) & (rc < C))


@triton.jit
def _scale_cast_kernel(acc_ptr, sa_ptr, sb_ptr, out_ptr, N, HAS_A: tl.constexpr,
                       HAS_B: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.load(acc_ptr + offs, mask=mask, other=0.0)
    if HAS_A:
        acc = acc * tl.load(sa_ptr)
    if HAS_B:
        acc = acc * tl.load(sb_ptr)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@library_op("hybrid_dist::mxfp8_dequantize")
def mxfp8_dequantize_op(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """bf16 ``[R, C]`` of MXFP8 ``data [R, C]`` with E8M0 ``scale [R, C/32]``."""
    r, c = data.shape
    out = torch.empty(r, c, dtype=torch.bfloat16, device=data.device)
    if data.numel():
        launch(_mxfp8_dequant_kernel, (cdiv(r, _BR), cdiv(c, _BC)),
               data, scale, out, r, c, BR=_BR, BC=_BC, num_warps=4)
    return out


@mxfp8_dequantize_op.register_fake
def _(data, scale):
    return data.new_empty(data.shape, dtype=torch.bfloat16)


@library_op("hybrid_dist::nvfp4_dequantize")
def nvfp4_dequantize_op(data: torch.Tensor, block_scale: torch.Tensor, block_rows: int) -> torch.Tensor:
    """bf16 ``[R, C]`` of packed NVFP4 ``data [R, C/2]`` with E4M3 ``block_scale``
    ``[R/block_rows, C/16]`` (global scale not applied)."""
    r, c = data.shape[0], data.shape[1] * 2
    out = torch.empty(r, c, dtype=torch.bfloat16, device=data.device)
    if data.numel():
        launch(_nvfp4_dequant_kernel, (cdiv(r, _BR), cdiv(c, _BC)),
               data, block_scale, out, r, c, BLOCK_ROWS=block_rows, BR=_BR, BC=_BC, num_warps=4)
    return out


@nvfp4_dequantize_op.register_fake
def _(data, block_scale, block_rows):
    return data.new_empty((data.shape[0], data.shape[1] * 2), dtype=torch.bfloat16)


@library_op("hybrid_dist::scale_cast")
def scale_cast_op(acc: torch.Tensor, scale_a: torch.Tensor | None, scale_b: torch.Tensor | None,
               out_dtype: torch.dtype) -> torch.Tensor:
    """``((acc · scale_a) · scale_b).to(out_dtype)`` for a contiguous fp32 ``acc``."""
    out = torch.empty(acc.shape, dtype=out_dtype, device=acc.device)
    n = acc.numel()
    if n:
        block = 4096
        launch(
            _scale_cast_kernel, (cdiv(n, block),), acc, scale_a if scale_a is not None else acc,
            scale_b if scale_b is not None else acc, out, n, HAS_A=scale_a is not None, HAS_B=scale_b is not None,
            BLOCK=block, num_warps=8)
    return out


@scale_cast_op.register_fake
def _(acc, scale_a, scale_b, out_dtype):
    return acc.new_empty(acc.shape, dtype=out_dtype)


mxfp8_dequantize = eager_or_op(mxfp8_dequantize_op, mxfp8_dequantize_op.fn)


nvfp4_dequantize = eager_or_op(nvfp4_dequantize_op, nvfp4_dequantize_op.fn)


scale_cast = eager_or_op(scale_cast_op, scale_cast_op.fn)
