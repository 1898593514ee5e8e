"""CUDA GEMMs ``out [Ra, Rb] = A_stored [Ra, C] · B_stored [Rb, C]ᵀ`` for every format pair.

* FP8 per-tensor × FP8 per-tensor (at least one E4M3): ``torch._scaled_mm`` with
  ``A = a.data`` (row-major) and ``B = b.data.t()`` (column-major), ``scale_inv`` as the
  decode scales — no transposes, since every stored direction is ``[rows, C]``.
* FP8 block (1×128 A with 1×128 or 128×128 B): ``torch.nn.functional.scaled_mm``
  blockwise (scales passed outer-dim-major as cuBLAS wants); other block pairs or shapes
  cuBLAS refuses fall through.
* Identity × identity (same dtype): a plain matmul in the native dtype (fp32 output from
  the same bf16 operands when an fp32 result is asked for).
* Everything else (MXFP8, NVFP4, mixed, E5M2×E5M2): each operand is dequantized by its
  block scales to bf16 (exact, see ``dequant``) and cuBLAS multiplies with fp32
  accumulation. Per-tensor scales: for an fp32 output they go on the fp32 accumulator (the
  reference's numbers up to summation order); for a bf16 output both are folded into the
  dequantize of one MXFP8/NVFP4 operand (each of its values rounded once to bf16 after the
  scaling: ≤ 2⁻⁸ relative per product term, beside the output's own bf16 rounding), so the
  GEMM writes bf16 and no fp32 accumulator pass runs. NVFP4 operands that share a
  Hadamard seed multiply in the transformed domain; an unshared transform defers to the
  reference.
Returns ``NotImplemented`` where the reference must decide.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid_dist.formats.float8 import Float8Storage
from hybrid_dist.formats.float8_block import Float8BlockStorage
from hybrid_dist.formats.identity import IdentityStorage
from hybrid_dist.formats.mxfp8 import MXFP8Storage
from hybrid_dist.formats.nvfp4 import NVFP4Storage
from hybrid_dist.kernels import dequant

E4M3 = torch.float8_e4m3fn


def _scaled_mm_tensorwise(a: Float8Storage, b: Float8Storage, out_dtype, config):
    if E4M3 not in (a.data.dtype, b.data.dtype):
        return None
    (ra, c), rb = a.data.shape, b.data.shape[0]  # Float8Storage.shape2d, without the property call
    if ra % 16 or rb % 16 or c % 16:
        return None
    return torch._scaled_mm(a.data, b.data.t(), scale_a=a.scale_inv, scale_b=b.scale_inv,
                            out_dtype=out_dtype, use_fast_accum=config.use_fast_accum)


_SCALING = getattr(F, "ScalingType", None)
# the int codes of aten._scaled_mm_v2's recipe lists (F.scaled_mm converts its enums the same way)
_BLOCK_1X128, _BLOCK_128X128 = ((int(_SCALING.BlockWise1x128.value), int(_SCALING.BlockWise128x128.value))
                                if _SCALING is not None else (None, None))


def _scaled_mm_blockwise(a: Float8BlockStorage, b: Float8BlockStorage, out_dtype):
    if _SCALING is None or a.block_rows != 1 or out_dtype not in (torch.bfloat16, torch.float32):
        return None
    scale_a = a.scale_inv.t().contiguous().t()  # [Ra, C/128], outer-dim-major
    if b.block_rows == 1:
        scale_b, recipe_b = b.scale_inv.t().contiguous().t(), _BLOCK_1X128
    else:  # [Rb/128, C/128] with the C blocks padded to a multiple of 4, passed transposed
        s = b.scale_inv
        scale_b, recipe_b = F.pad(s, (0, -s.shape[1] % 4)).t(), _BLOCK_128X128
    try:  # the aten op itself: Dynamo traces it (not F.scaled_mm's pybind ``torch._scaled_mm_v2``)
        return torch.ops.aten._scaled_mm_v2.default(a.data, b.data.t(), [scale_a], [_BLOCK_1X128], [], [scale_b],
                                                    [recipe_b], [], None, out_dtype)
    except torch.cuda.OutOfMemoryError:
        raise
    except (RuntimeError, NotImplementedError, ValueError):  # layout/shape not supported
        return None


def bf16_operand(st, tensor_scale_a=None, tensor_scale_b=None, *, row_scale=None, col_scale=None):
    """bf16 ``[R, C]`` with block scales applied (exact), or None if not exact in bf16.
    ``tensor_scale_a/_b`` (fp32 scalars) and ``row_scale [R]`` / ``col_scale [C]`` (fp32;
    MXFP8/NVFP4 only): also multiplied in, one rounding (``kernels.dequant``). The
    dequantize kernels index row-major buffers: strided views (e.g. a transposed saved or
    gathered field) are made contiguous first."""
    if isinstance(st, MXFP8Storage):
        return dequant.mxfp8_dequantize(st.data.contiguous(), st.scale.contiguous(), tensor_scale_a, tensor_scale_b,
                                        row_scale, col_scale)
    if isinstance(st, NVFP4Storage):
        return dequant.nvfp4_dequantize(st.data.contiguous(), st.block_scale.contiguous(), st.block_rows,
                                        tensor_scale_a, tensor_scale_b, row_scale, col_scale)
    if any(s is not None for s in (tensor_scale_a, tensor_scale_b, row_scale, col_scale)):
        return None
    if isinstance(st, Float8Storage):
        return st.data.to(torch.bfloat16)
    if isinstance(st, IdentityStorage) and st.data.dtype == torch.bfloat16:
        return st.data
    return None


def _scaled_bf16_operands(a, b, sa, sb):
    """``(va, vb)`` with both per-tensor scales folded into a block-format operand, or None."""
    if isinstance(a, (MXFP8Storage, NVFP4Storage)):
        vb = bf16_operand(b)
        return None if vb is None else (bf16_operand(a, sa, sb), vb)
    if isinstance(b, (MXFP8Storage, NVFP4Storage)):
        va = bf16_operand(a)
        return None if va is None else (va, bf16_operand(b, sa, sb))
    return None


def _mm_fp32(va: torch.Tensor, vb_t: torch.Tensor) -> torch.Tensor:
    try:
        return torch.mm(va, vb_t, out_dtype=torch.float32)
    except (TypeError, RuntimeError):  # torch without mm(out_dtype=): exact fp32 products
        return torch.mm(va.float(), vb_t.float())


def _dequant_gemm(a, b, out_dtype):
    seeds = (getattr(a, "rht_seed", None), getattr(b, "rht_seed", None))
    if seeds[0] != seeds[1]:
        return NotImplemented  # one operand must be transformed back: reference
    sa, sb = a.tensor_scale(), b.tensor_scale()
    if out_dtype == torch.bfloat16 and (sa is not None or sb is not None):
        folded = _scaled_bf16_operands(a, b, sa, sb)
        if folded is not None:
            return torch.mm(folded[0], folded[1].t())
    va, vb = bf16_operand(a), bf16_operand(b)
    if va is None or vb is None:
        return NotImplemented
    if sa is None and sb is None and out_dtype == torch.bfloat16:
        return torch.mm(va, vb.t())
    acc = _mm_fp32(va, vb.t())
    if sa is None and sb is None:
        return acc.to(out_dtype)
    return dequant.scale_cast(acc, sa, sb, out_dtype)


def gemm_nt_cuda(a, b, *, out_dtype, config):
    """Registry GEMM impl (see module doc)."""
    if isinstance(a, Float8Storage) and isinstance(b, Float8Storage):
        out = _scaled_mm_tensorwise(a, b, out_dtype, config)
        if out is not None:
            return out
    if isinstance(a, IdentityStorage) and isinstance(b, IdentityStorage):
        if a.data.dtype != b.data.dtype:
            return NotImplemented
        if out_dtype == a.data.dtype or a.data.dtype == torch.float32:
            return torch.mm(a.data, b.data.t()).to(out_dtype)
        return _mm_fp32(a.data, b.data.t()).to(out_dtype)
    if isinstance(a, Float8BlockStorage) or isinstance(b, Float8BlockStorage):
        if isinstance(a, Float8BlockStorage) and isinstance(b, Float8BlockStorage):
            out = _scaled_mm_blockwise(a, b, out_dtype)
            if out is not None:
                return out
        return NotImplemented
    return _dequant_gemm(a, b, out_dtype)
