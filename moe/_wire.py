"""Quantized token payloads: rowwise storages packed into one byte row per token.

A rowwise direction whose blocks run along K only (block rows = 1: per-tensor FP8, MXFP8
1×32, FP8 1×128, NVFP4 1×16, identity) quantizes each token on its own, given the
per-tensor amax. So a source rank can quantize the rows it sends to expert e with the
amax of **all** of e's rows (one all-reduce MAX of an ``[E]`` vector) and the receiver
gets exactly the rows it would have made from the high-precision tokens.

Wire row of one token: the row-axis fields of the storage (``data``, block scales) viewed
as bytes and concatenated: ``[m, Σ bytes per row]`` uint8. Per-tensor fields are not sent:
the receiver recomputes them from the same all-reduced amax (``template``).

The columnwise direction blocks along tokens that come from several ranks, so it is made
at the receiver: derived exactly from the rowwise bits where the format allows (per-tensor
FP8 with one quantizer for both directions: a transpose; identity). ``unsupported_reason``
says when a quantizer cannot use this path (the caller then exchanges high precision).
"""

from __future__ import annotations

import dataclasses

import torch

from hybrid_dist.formats.float8 import Float8Quantizer, Float8Storage
from hybrid_dist.formats.identity import IdentityQuantizer, IdentityStorage
from hybrid_dist.formats.nvfp4 import NVFP4Quantizer
from hybrid_dist.formats import DirectionStorage


def unsupported_reason(q, *, need_columnwise: bool) -> str | None:
    """None if ``q``'s rowwise can be quantized per source rank (and its columnwise derived
    at the receiver when needed); else why not."""
    row, col = q.direction_quantizer("rowwise"), q.direction_quantizer("columnwise")
    if row.block_shape("rowwise")[0] != 1:
        return f"{type(row).__name__} rowwise blocks span {row.block_shape('rowwise')[0]} tokens"
    if isinstance(row, Float8Quantizer) and row.scaling == "delayed":
        return "delayed scaling keeps its amax history on the expert's rank"
    if isinstance(row, NVFP4Quantizer) and row.stochastic_rounding:
        return "stochastic rounding draws from the expert's generator"
    if need_columnwise and not derivable_columnwise(q):
        return (f"the columnwise (wgrad) direction {type(col).__name__} blocks along tokens from "
                "several ranks and cannot be derived from the rowwise bits")
    return None


def derivable_columnwise(q) -> bool:
    row, col = q.direction_quantizer("rowwise"), q.direction_quantizer("columnwise")
    return row == col and isinstance(row, (Float8Quantizer, IdentityQuantizer))


def derive_columnwise(row: DirectionStorage) -> DirectionStorage:
    """The columnwise storage ``[K, p]`` that the quantizer would make (see module doc)."""
    if isinstance(row, Float8Storage):
        return Float8Storage(data=row.data.t().contiguous(), scale_inv=row.scale_inv, transposed=True)
    if isinstance(row, IdentityStorage):
        return IdentityStorage(data=row.data.t(), transposed=True)
    raise AssertionError(f"no derived columnwise for {type(row).__name__}")


def _row_fields(st: DirectionStorage) -> list[str]:
    return [f for f in st.TENSOR_FIELDS if "R" in st.field_axes()[f]]


def template(q, k: int, amax: torch.Tensor, like: torch.Tensor) -> DirectionStorage:
    """An empty ``[0, K]`` rowwise storage carrying the per-tensor fields for ``amax``."""
    row, _ = q.direction_quantizer("rowwise").quantize_storages(
        like.new_zeros(0, k), rowwise=True, columnwise=False, amax=amax)
    return row


def pack(st: DirectionStorage) -> torch.Tensor:
    """``[m, bytes]`` uint8: the row fields of a rowwise storage side by side."""
    parts = [getattr(st, f).contiguous() for f in _row_fields(st)]
    return torch.cat([p.reshape(p.shape[0], torch.Size(p.shape[1:]).numel()).view(torch.uint8) for p in parts], dim=1)


def row_bytes(tmpl: DirectionStorage) -> int:
    """Bytes one token takes on the wire in ``tmpl``'s format."""
    return sum(getattr(tmpl, f).element_size() * torch.Size(getattr(tmpl, f).shape[1:]).numel()
               for f in _row_fields(tmpl))


def unpack(buf: torch.Tensor, tmpl: DirectionStorage, rows: int) -> DirectionStorage:
    """Inverse of ``pack`` into ``tmpl``'s format, zero-padded to ``rows`` rows."""
    out, col = {}, 0
    m = buf.shape[0]
    for f in _row_fields(tmpl):
        t = getattr(tmpl, f)
        width = t.element_size() * torch.Size(t.shape[1:]).numel()
        field = buf[:, col:col + width].contiguous().view(t.dtype).reshape(m, *t.shape[1:])
        out[f] = torch.cat([field, field.new_zeros(rows - m, *t.shape[1:])]) if rows > m else field
        col += width
    return dataclasses.replace(tmpl, **out)
