"""MXFP8: E4M3 elements, one E8M0 (power-of-two) scale per 32 consecutive elements.

Layout for a logical ``[M, K]`` tensor (stored forms, see ``_storage``):

* rowwise    ``data`` fp8 ``[M, K]``, ``scale`` uint8 ``[M, K/32]`` (1×32 blocks along K);
* columnwise ``data`` fp8 ``[K, M]``, ``scale`` uint8 ``[K, M/32]`` (32×1 blocks along M,
  stored transposed so the GEMM contracts the last dim).

``scale`` holds the biased exponent ``e``: the block decodes as ``x ≈ q · 2**(e-127)``.
``e = ceil_pow2(amax_block / 448)`` (RCEIL: the exponent is rounded **up** when the
mantissa of ``amax/448`` is non-zero, as cuBLAS and TE), so no element saturates. The two
directions are numerically different and cannot be derived from each other.
Shape rules: rowwise needs ``K % 32 == 0``, columnwise ``M % 32 == 0``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from hybrid_dist.formats.numerics import (
    FP8_MAX,
    cast_to_fp8,
    check_fp8_dtype,
    e8m0_from_amax,
    e8m0_to_inv_scale,
    e8m0_to_scale,
)
from hybrid_dist.formats._quantizer import Quantizer
from hybrid_dist.formats._storage import DirectionStorage, FieldAxes

MX_BLOCK = 32


@dataclasses.dataclass(frozen=True, kw_only=True)
class MXFP8Storage(DirectionStorage):
    """``data`` fp8 ``[R, C]``; ``scale`` uint8 E8M0 ``[R, C/32]``."""

    TENSOR_FIELDS = ("data", "scale")
    FORMAT = "mxfp8"
    data: torch.Tensor
    scale: torch.Tensor

    def field_axes(self) -> FieldAxes:
        return {"data": {"R": (0, 1), "C": (1, 1)}, "scale": {"R": (0, 1), "C": (1, MX_BLOCK)}}

    def values(self, *, undo_rht: bool = True):
        r, c = self.shape2d
        blocks = self.data.float().reshape(r, c // MX_BLOCK, MX_BLOCK)
        return (blocks * e8m0_to_scale(self.scale).unsqueeze(-1)).reshape(r, c)


def mxfp8_quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: quantize ``x [R, C]`` with 1×32 blocks along C → ``(data, scale)``."""
    r, c = x.shape
    blocks = x.float().reshape(r, c // MX_BLOCK, MX_BLOCK)
    e = e8m0_from_amax(blocks.abs().amax(dim=-1), FP8_MAX[dtype])
    data = cast_to_fp8(blocks * e8m0_to_inv_scale(e).unsqueeze(-1), dtype)
    return data.reshape(r, c), e


@dataclasses.dataclass(frozen=True, kw_only=True)
class MXFP8Quantizer(Quantizer):
    """MXFP8 with 32-element blocks and E8M0 scales (E4M3 elements by default)."""

    FORMAT: ClassVar[str] = "mxfp8"
    PRECISION_RANK: ClassVar[int] = 4
    dtype: torch.dtype = torch.float8_e4m3fn

    def __post_init__(self):
        check_fp8_dtype(self.dtype)

    def block_shape(self, direction):
        return (1, MX_BLOCK) if direction == "rowwise" else (MX_BLOCK, 1)

    def _quantize_2d(self, x, *, rowwise, columnwise, state, amax):
        row = col = None
        if rowwise:
            data, scale = mxfp8_quantize_rows(x, self.dtype)
            row = MXFP8Storage(data=data, scale=scale, transposed=False)
        if columnwise:
            data, scale = mxfp8_quantize_rows(x.t(), self.dtype)
            col = MXFP8Storage(data=data, scale=scale, transposed=True)
        return row, col
