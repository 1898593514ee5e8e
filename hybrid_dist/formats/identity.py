"""Identity: a high-precision passthrough direction ("BF16 backward").

Layout for a logical ``[M, K]`` tensor: rowwise ``data`` ``[M, K]``; columnwise ``data``
``[K, M]`` (a transposed **view** of the same memory, no copy). ``dtype=None`` keeps the
input's dtype; otherwise the data is cast to ``dtype`` (e.g. keep an fp32 copy).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from hybrid_dist.formats._quantizer import Quantizer
from hybrid_dist.formats._storage import DirectionStorage, FieldAxes


@dataclasses.dataclass(frozen=True, kw_only=True)
class IdentityStorage(DirectionStorage):
    """``data`` high precision ``[R, C]``."""

    TENSOR_FIELDS = ("data",)
    FORMAT = "identity"
    data: torch.Tensor

    def field_axes(self) -> FieldAxes:
        return {"data": {"R": (0, 1), "C": (1, 1)}}

    def values(self, *, undo_rht: bool = True):
        return self.data.float()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.data.t() if self.transposed else self.data).to(dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class IdentityQuantizer(Quantizer):
    """Keeps the tensor in high precision (optionally cast to ``dtype``)."""

    FORMAT: ClassVar[str] = "identity"
    PRECISION_RANK: ClassVar[int] = 10
    dtype: torch.dtype | None = None

    def __post_init__(self):
        if self.dtype is not None and not self.dtype.is_floating_point:
            raise ValueError(f"IdentityQuantizer dtype must be a floating dtype or None, got {self.dtype}")
        if self.dtype is not None and self.dtype.itemsize == 1:
            raise ValueError(f"IdentityQuantizer keeps high precision; use Float8Quantizer for {self.dtype}")

    def block_shape(self, direction):
        return (1, 1)

    def _quantize_2d(self, x, *, rowwise, columnwise, state, amax):
        data = x if self.dtype is None else x.to(self.dtype)
        row = IdentityStorage(data=data, transposed=False) if rowwise else None
        col = IdentityStorage(data=data.t(), transposed=True) if columnwise else None
        return row, col
