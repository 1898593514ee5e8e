"""The columnwise storage made from the rowwise one, where that is exact.

One per-tensor FP8 quantizer for both directions writes both from one scale, so its
columnwise codes ``[K, M]`` are its rowwise codes ``[M, K]`` transposed, byte for byte; an
identity (high-precision) direction is its data transposed. Whoever moves such a tensor
(the MoE exchange, the TP gathers) sends the rowwise direction and derives the columnwise
one after: half the bytes, and the result is bitwise what quantizing both would give.
"""

from __future__ import annotations

from hybrid_dist.formats import DirectionStorage, Quantizer
from hybrid_dist.formats.float8 import Float8Quantizer, Float8Storage
from hybrid_dist.formats.identity import IdentityQuantizer, IdentityStorage
from hybrid_dist.kernels import transposed_2d


def derivable_columnwise(q: Quantizer) -> bool:
    """The columnwise storage is the rowwise one transposed (exact)."""
    row, col = q.direction_quantizer("rowwise"), q.direction_quantizer("columnwise")
    return row == col and isinstance(row, (Float8Quantizer, IdentityQuantizer))


def derive_columnwise(row: DirectionStorage) -> DirectionStorage:
    """The columnwise storage ``[K, M]`` the quantizer would make, from the rowwise
    ``[M, K]`` one (``derivable_columnwise``)."""
    if isinstance(row, Float8Storage):
        return Float8Storage(data=transposed_2d(row.data), scale_inv=row.scale_inv, transposed=True)
    if isinstance(row, IdentityStorage):
        return IdentityStorage(data=row.data.t(), transposed=True)
    raise AssertionError(f"no derived columnwise for {type(row).__name__}")
