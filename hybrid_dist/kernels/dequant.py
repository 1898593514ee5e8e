"""Bandwidth-bound dequantize-to-bf16 kernels (the GEMM operand path of block formats).

Each kernel turns one stored direction ``[R, C]`` into bf16 ``[R, C]`` with its block
scales applied. Without per-tensor scales the values are exact in bf16: E4M3 × 2**k
(MXFP8, k in E8M0 range of normal bf16) and E2M1 × E4M3 (NVFP4: at most 5 significant
bits). Given fp32 per-tensor scalars ``ta``, ``tb`` (a GEMM's two operands' scales, folded
into one operand), each value is ``v · (ta · tb)`` computed in fp32 and rounded once to
bf16: relative error ≤ 2⁻⁸ per element. Given an fp32 per-row ``row_scale [R]`` or
per-column ``col_scale [C]`` (grouped GEMMs: each packed token's expert scales), it is
multiplied in after those, in fp32, before the one rounding: bitwise
``(v.float() · row_scale[:, None]).to(bf16)`` of the exact values. ``scale_cast`` applies
per-tensor scales to an fp32 accumulator and casts, in the reference's order
(``(acc · s_a) · s_b``, then one rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_dist.kernels._jit_common import INTERPRET, cdiv, e2m1_decode, eager_or_op, exp2_int, round_bf16
from hybrid_dist.kernels._launch import launch
from hybrid_dist.kernels._traced import kernel_op, traced_launch

_BR, _BC = 64, 128  # MXFP8 tile [rows, columns]
_NV_TILE = (16, 512)  # NVFP4 tile [rows, columns] (H200: 3.0 TB/s against 2.6 at 64 × 128)


@triton.jit
def _tensor_scale(ta_ptr, tb_ptr, HAS_A: tl.constexpr, HAS_B: tl.constexpr):
    """fp32 ``ta · tb`` of the scalars present (1.0 for none)."""
    t = 1.0
    if HAS_A:
        t = tl.load(ta_ptr)
    if HAS_B:
        t = t * tl.load(tb_ptr)
    return t


@triton.jit
def _line_scales(v, rs_ptr, cs_ptr, rr, rc, R, C, HAS_ROW: tl.constexpr, HAS_COL: tl.constexpr):
    """``v [BR, BC]`` times the fp32 per-row / per-column scales present."""
    if HAS_ROW:
        v = v * tl.load(rs_ptr + rr, mask=rr < R, other=1.0)
    if HAS_COL:
        v = v * tl.load(cs_ptr + rc, mask=rc < C, other=1.0)
    return v


@triton.jit
def _to_bf16(v):
    """RNE to bf16 (``cvt.rn`` on the GPU; on the bits under the interpreter, whose cast does not round so)."""
    if INTERPRET:
        v = round_bf16(v)
    return v.to(tl.bfloat16)


@triton.jit
def _mxfp8_dequant_kernel(d_ptr, s_ptr, ta_ptr, tb_ptr, rs_ptr, cs_ptr, out_ptr, R, C, HAS_A: tl.constexpr,
                          HAS_B: tl.constexpr, HAS_ROW: tl.constexpr, HAS_COL: tl.constexpr,
                          BR: tl.constexpr, BC: tl.constexpr):
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rr = pid_r * BR + tl.arange(0, BR)[:, None]
    rc = pid_c * BC + tl.arange(0, BC)[None, :]
    mask = (rr < R) & (rc < C)
    q = tl.load(d_ptr + rr * C + rc, mask=mask, other=0.0).to(tl.float32)
    sc = pid_c * (BC // 32) + tl.arange(0, BC // 32)[None, :]
    e = tl.load(s_ptr + rr * (C // 32) + sc, mask=(rr < R) & (sc < C // 32), other=127).to(tl.int32)
    v = tl.reshape(q, (BR, BC // 32, 32)) * exp2_int(e - 127)[:, :, None]
    if HAS_A or HAS_B:
        v = v * _tensor_scale(ta_ptr, tb_ptr, HAS_A, HAS_B)
    v = _line_scales(tl.reshape(v, (BR, BC)), rs_ptr, cs_ptr, rr, rc, R, C, HAS_ROW, HAS_COL)
    tl.store(out_ptr + rr * C + rc, _to_bf16(v), mask=mask)


@triton.jit
def _nvfp4_dequant_kernel(d_ptr, s_ptr, ta_ptr, tb_ptr, rs_ptr, cs_ptr, out_ptr, R, C, BLOCK_ROWS: tl.constexpr,
                          HAS_A: tl.constexpr, HAS_B: tl.constexpr, HAS_ROW: tl.constexpr, HAS_COL: tl.constexpr,
                          BR: tl.constexpr, BC: tl.constexpr):
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rr = pid_r * BR + tl.arange(0, BR)[:, None]
    pc = pid_c * (BC // 2) + tl.arange(0, BC // 2)[None, :]
    packed = tl.load(d_ptr + rr * (C // 2) + pc, mask=(rr < R) & (pc < C // 2), other=0).to(tl.int32)
    v = tl.reshape(tl.join(e2m1_decode(packed & 0xF), e2m1_decode(packed >> 4)), (BR, BC))
    sr = pid_r * (BR // BLOCK_ROWS) + tl.arange(0, BR // BLOCK_ROWS)[:, None]
    sc = pid_c * (BC // 16) + tl.arange(0, BC // 16)[None, :]
    s = tl.load(s_ptr + sr * (C // 16) + sc, mask=(sr < R // BLOCK_ROWS) & (sc < C // 16), other=0.0).to(tl.float32)
    v = tl.reshape(v, (BR // BLOCK_ROWS, BLOCK_ROWS, BC // 16, 16)) * s[:, None, :, None]  # exact
    if HAS_A or HAS_B:
        v = v * _tensor_scale(ta_ptr, tb_ptr, HAS_A, HAS_B)
    rc = pid_c * BC + tl.arange(0, BC)[None, :]
    v = _line_scales(tl.reshape(v, (BR, BC)), rs_ptr, cs_ptr, rr, rc, R, C, HAS_ROW, HAS_COL)
    tl.store(out_ptr + rr * C + rc, _to_bf16(v), mask=(rr < R) & (rc < C))


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


def _optional(stand_in, **tensors):
    """Kernel pointer arguments for optional tensors (``stand_in`` where absent) and
    their ``HAS_*`` flags."""
    ptrs = [stand_in if t is None else t for t in tensors.values()]
    flags = {f"HAS_{k}": t is not None for k, t in tensors.items()}
    return ptrs, flags


def _mxfp8_dequantize(data, scale, ta=None, tb=None, row_scale=None, col_scale=None, run=None):
    """bf16 ``[R, C]`` of MXFP8 ``data [R, C]`` with E8M0 ``scale [R, C/32]``, times the
    fp32 scalars ``ta · tb`` and the fp32 ``row_scale [R]`` / ``col_scale [C]`` where
    given (then one rounding)."""
    r, c = data.shape
    out = torch.empty(r, c, dtype=torch.bfloat16, device=data.device)
    if data.numel():
        ptrs, flags = _optional(scale, A=ta, B=tb, ROW=row_scale, COL=col_scale)
        (run or launch)(_mxfp8_dequant_kernel, (cdiv(r, _BR), cdiv(c, _BC)), data, scale, *ptrs, out, r, c,
            **flags, BR=_BR, BC=_BC, num_warps=4)
    return out


def _nvfp4_dequantize(data, block_scale, block_rows, ta=None, tb=None, row_scale=None, col_scale=None, run=None):
    """bf16 ``[R, C]`` of packed NVFP4 ``data [R, C/2]`` with E4M3 ``block_scale``
    ``[R/block_rows, C/16]``, times the fp32 scalars ``ta · tb`` and the fp32
    ``row_scale [R]`` / ``col_scale [C]`` where given (then one rounding; the global scale
    is not applied otherwise)."""
    r, c = data.shape[0], data.shape[1] * 2
    out = torch.empty(r, c, dtype=torch.bfloat16, device=data.device)
    if data.numel():
        br, bc = _NV_TILE
        ptrs, flags = _optional(block_scale, A=ta, B=tb, ROW=row_scale, COL=col_scale)
        (run or launch)(_nvfp4_dequant_kernel, (cdiv(r, br), cdiv(c, bc)), data, block_scale, *ptrs, out, r, c,
            BLOCK_ROWS=block_rows, **flags, BR=br, BC=bc, num_warps=4)
    return out


def _scale_cast(acc, scale_a, scale_b, out_dtype, run=None):
    """``((acc · scale_a) · scale_b).to(out_dtype)`` for a contiguous fp32 ``acc``."""
    out = torch.empty(acc.shape, dtype=out_dtype, device=acc.device)
    n = acc.numel()
    if n:
        block = 4096
        (run or launch)(_scale_cast_kernel, (cdiv(n, block),), acc, scale_a if scale_a is not None else acc,
            scale_b if scale_b is not None else acc, out, n, HAS_A=scale_a is not None, HAS_B=scale_b is not None,
            BLOCK=block, num_warps=8)
    return out


# compiled graphs launch the same kernels directly (``kernels._traced``)
@kernel_op("hybrid_dist::mxfp8_dequantize",
           fake=lambda data, scale, ta=None, tb=None, row_scale=None, col_scale=None: data.new_empty(
               data.shape, dtype=torch.bfloat16))
def mxfp8_dequantize_op(data: torch.Tensor, scale: torch.Tensor, ta: torch.Tensor | None = None,
                        tb: torch.Tensor | None = None, row_scale: torch.Tensor | None = None,
                        col_scale: torch.Tensor | None = None) -> torch.Tensor:
    return _mxfp8_dequantize(data, scale, ta, tb, row_scale, col_scale, run=traced_launch)


@kernel_op("hybrid_dist::nvfp4_dequantize",
           fake=lambda data, block_scale, block_rows, ta=None, tb=None, row_scale=None, col_scale=None:
           data.new_empty((data.shape[0], data.shape[1] * 2), dtype=torch.bfloat16))
def nvfp4_dequantize_op(data: torch.Tensor, block_scale: torch.Tensor, block_rows: int,
                        ta: torch.Tensor | None = None, tb: torch.Tensor | None = None,
                        row_scale: torch.Tensor | None = None, col_scale: torch.Tensor | None = None) -> torch.Tensor:
    return _nvfp4_dequantize(data, block_scale, block_rows, ta, tb, row_scale, col_scale, run=traced_launch)


@kernel_op("hybrid_dist::scale_cast",
           fake=lambda acc, scale_a, scale_b, out_dtype: acc.new_empty(acc.shape, dtype=out_dtype))
def scale_cast_op(acc: torch.Tensor, scale_a: torch.Tensor | None, scale_b: torch.Tensor | None,
                  out_dtype: torch.dtype) -> torch.Tensor:
    return _scale_cast(acc, scale_a, scale_b, out_dtype, run=traced_launch)


mxfp8_dequantize = eager_or_op(mxfp8_dequantize_op, _mxfp8_dequantize)
nvfp4_dequantize = eager_or_op(nvfp4_dequantize_op, _nvfp4_dequantize)
scale_cast = eager_or_op(scale_cast_op, _scale_cast)
