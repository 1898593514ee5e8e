"""FP8 with fp32 scales per 1×128 or 128×128 block (DeepSeek-V3 style).

Layout for a logical ``[M, K]`` tensor (stored forms, see ``_storage``):

* ``block="1x128"``: rowwise ``data`` fp8 ``[M, K]``, ``scale_inv`` fp32 ``[M, K/128]``;
  columnwise ``data`` ``[K, M]``, ``scale_inv`` ``[K, M/128]`` (128×1 blocks along M). The
  directions differ numerically. Needs rowwise ``K % 128``, columnwise ``M % 128``.
* ``block="128x128"``: rowwise ``scale_inv`` ``[M/128, K/128]``; columnwise is the exact
  transpose of rowwise (data and scales). Needs ``M % 128`` and ``K % 128`` both ways.

Per block: ``scale = fp8_max / max(amax_block, amax_epsilon)`` (amax 0 → 1), rounded down
to a power of two when ``power_of_2_scales`` (the default, as TE); ``scale_inv = 1/scale``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from hybrid_dist.formats.numerics import FP8_MAX, cast_to_fp8, check_fp8_dtype, scale_from_amax
from hybrid_dist.formats._quantizer import Quantizer
from hybrid_dist.formats._storage import DirectionStorage, FieldAxes

BLOCK = 128


@dataclasses.dataclass(frozen=True, kw_only=True)
class Float8BlockStorage(DirectionStorage):
    """``data`` fp8 ``[R, C]``; ``scale_inv`` fp32 ``[R/br, C/128]`` (br = 1 or 128)."""

    TENSOR_FIELDS = ("data", "scale_inv")
    FORMAT = "fp8_block"
    data: torch.Tensor
    scale_inv: torch.Tensor
    block_rows: int  # 1 for 1x128, 128 for 128x128

    def field_axes(self) -> FieldAxes:
        return {
            "data": {"R": (0, 1), "C": (1, 1)},
            "scale_inv": {"R": (0, self.block_rows), "C": (1, BLOCK)},
        }

    def values(self, *, undo_rht: bool = True):
        r, c = self.shape2d
        br = self.block_rows
        blocks = self.data.float().reshape(r // br, br, c // BLOCK, BLOCK)
        return (blocks * self.scale_inv[:, None, :, None]).reshape(r, c)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Float8BlockQuantizer(Quantizer):
    """FP8 E4M3 (or E5M2) with per-block fp32 scales; ``block`` is "1x128" or "128x128"."""

    FORMAT: ClassVar[str] = "fp8_block"
    PRECISION_RANK: ClassVar[int] = 5
    dtype: torch.dtype = torch.float8_e4m3fn
    block: str = "1x128"
    power_of_2_scales: bool = True
    amax_epsilon: float = 0.0

    def __post_init__(self):
        check_fp8_dtype(self.dtype)
        if self.block not in ("1x128", "128x128"):
            raise ValueError(f"block must be '1x128' or '128x128', got {self.block!r}")

    @property
    def block_rows(self) -> int:
        return 1 if self.block == "1x128" else BLOCK

    def block_shape(self, direction):
        if self.block == "128x128":
            return (BLOCK, BLOCK)
        return (1, BLOCK) if direction == "rowwise" else (BLOCK, 1)

    def quantize_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference: quantize ``x [R, C]`` with blocks along C → ``(data, scale_inv)``."""
        r, c = x.shape
        br = self.block_rows
        blocks = x.float().reshape(r // br, br, c // BLOCK, BLOCK)
        amax = blocks.abs().amax(dim=(1, 3)).clamp(min=self.amax_epsilon)
        scale = scale_from_amax(amax, FP8_MAX[self.dtype], pow2=self.power_of_2_scales)
        data = cast_to_fp8(blocks * scale[:, None, :, None], self.dtype).reshape(r, c)
        return data, torch.reciprocal(scale)

    def _quantize_2d(self, x, *, rowwise, columnwise, state, amax):
        row = col = None
        if self.block == "128x128":
            data, scale_inv = self.quantize_rows(x)
            if rowwise:
                row = Float8BlockStorage(data=data, scale_inv=scale_inv, block_rows=BLOCK, transposed=False)
            if columnwise:
                col = Float8BlockStorage(
                    data=data.t().contiguous(), scale_inv=scale_inv.t().contiguous(),
                    block_rows=BLOCK, transposed=True,
                )
            return row, col
        if rowwise:
            data, scale_inv = self.quantize_rows(x)
            row = Float8BlockStorage(data=data, scale_inv=scale_inv, block_rows=1, transposed=False)
        if columnwise:
            data, scale_inv = self.quantize_rows(x.t())
            col = Float8BlockStorage(data=data, scale_inv=scale_inv, block_rows=1, transposed=True)
        return row, col
