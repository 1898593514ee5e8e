"""``split_quantize``: quantize each expert's token slice of ``x [T, K]`` with its own
quantizer and state, both directions from one call per expert.

[Note: grouped layout]
Tokens arrive sorted by expert: expert ``e`` owns rows ``[off_e, off_e + m_e)`` of
``x_TK`` with ``m_e = tokens_per_expert[e]``, ``off = [0, cumsum(m)]``. Formats whose
columnwise blocks run along the token dim (MXFP8 32, NVFP4 16, FP8 1x128 → 128x1: 128)
cannot quantize a slice whose length is not a block multiple, so each expert's slice is
**zero-padded** to ``p_e = ceil(m_e / b) · b`` rows, ``b = token_multiple(...)``:

    padded offsets   poff = [0, cumsum(p)]                    (on device: no host sync)
    rowwise  e       stored [p_e, K]   (rows m_e..p_e are quantized zeros)
    columnwise e     stored [K, p_e]   (blocks along the padded token dim; the padding
                                        columns are exact zeros, so wgrad is unchanged)

Both directions use the same padded row index space, so one ``poff`` addresses both, and
the per-expert GEMM shapes equal those of an ``hd.Linear`` run on the padded slice (CPU
matmul results depend on M, so this is what makes the grouped reference bitwise equal to a
per-expert loop). Zero padding changes neither amax nor any real element's code.

Packed (GPU) form, ``GroupedQuantized.packed(direction)``: each tensor field of the
per-expert storages concatenated along its token axis (``field_axes`` ``"R"`` for rowwise,
``"C"`` for columnwise) into one buffer of ``T_pad = poff[-1]`` token rows, and each
per-tensor field (FP8 ``scale_inv``, NVFP4 ``global_scale``) stacked into ``[E]``. A GPU
kernel can size the buffers by the static bound ``T_pad <= T + E·(b-1)`` and read ``poff``
on device, so quantizing needs no device-to-host sync.

Where the reference syncs: ``tokens_per_expert.tolist()`` once per call (to slice on the
host). Nothing else reads device values on the host. ``device_split.split_quantize_packed``
builds the packed form directly, sized by that static bound, with no sync (bitwise equal
to ``packed()`` of this function for the formats it supports; with
``per_expert_draws=True`` for NVFP4 stochastic rounding too).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import torch

from hybrid_dist.formats import Quantizer
from hybrid_dist.formats import DirectionStorage

__all__ = ["GroupedQuantized", "split_quantize", "token_multiple", "padded_offsets"]


def token_multiple(*quantizers: Quantizer) -> int:
    """The padding multiple along tokens: the lcm of every quantizer's block rows (both
    directions; rowwise 2D blocks count too) — x and dy must pad alike for wgrad."""
    mult = 1
    for q in quantizers:
        for d in ("rowwise", "columnwise"):
            mult = math.lcm(mult, q.direction_quantizer(d).block_shape(d)[0])
    return mult


def padded_offsets(tokens_per_expert: torch.Tensor, multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Device ``(offsets [E+1], padded_offsets [E+1])`` (int64), computed without a sync."""
    m = tokens_per_expert.to(torch.int64)
    p = (m + multiple - 1) // multiple * multiple
    zero = m.new_zeros(1)
    return torch.cat([zero, m.cumsum(0)]), torch.cat([zero, p.cumsum(0)])


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupedQuantized:
    """Per-expert storages of a token-grouped tensor (layout: module note above).

    ``rowwise[e]`` stored ``[p_e, K]``, ``columnwise[e]`` stored ``[K, p_e]`` (or None when
    not asked for). ``splits``/``padded_splits`` are host ints (the reference's view);
    ``offsets``/``padded_offsets`` ``[E+1]`` int64 live on x's device.
    """

    rowwise: list[DirectionStorage | None]
    columnwise: list[DirectionStorage | None]
    splits: list[int]
    padded_splits: list[int]
    offsets: torch.Tensor
    padded_offsets: torch.Tensor

    @property
    def num_groups(self) -> int:
        return len(self.splits)

    def storages(self, direction: str) -> list[DirectionStorage | None]:
        return self.rowwise if direction == "rowwise" else self.columnwise

    def packed(self, direction: str) -> dict[str, torch.Tensor]:
        """One buffer per field (see the note): token-axis fields concatenated, per-tensor
        fields stacked to ``[E]``."""
        sts = self.storages(direction)
        if any(st is None for st in sts):
            raise ValueError(f"GroupedQuantized has no {direction} direction; quantize with {direction}=True")
        key = "C" if direction == "columnwise" else "R"
        out = {}
        for f in sts[0].TENSOR_FIELDS:
            ax = sts[0].field_axes()[f].get(key)
            ts = [getattr(st, f) for st in sts]
            out[f] = torch.stack(ts) if ax is None else torch.cat(ts, dim=ax[0])
        return out

    def nbytes(self, direction: str) -> int:
        return sum(t.numel() * t.element_size() for t in self.packed(direction).values())


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x [m, K]`` with zero rows appended up to ``rows``."""
    if rows == x.shape[0]:
        return x
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


def split_quantize(
    x: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    quantizers: Sequence[Quantizer],
    *,
    rowwise: bool = True,
    columnwise: bool = True,
    states: Sequence[Any] | None = None,
    multiple: int | None = None,
) -> GroupedQuantized:
    """Quantize expert ``e``'s rows of ``x [T, K]`` with ``quantizers[e]`` / ``states[e]``.

    ``tokens_per_expert``: int tensor ``[E]`` on x's device summing to T. ``multiple``: the
    token padding multiple (default ``token_multiple(*quantizers)``; pass a larger common
    one when another operand of the same GEMM pads more). Per-tensor formats get one scale
    per expert. Returns a :class:`GroupedQuantized` (padded layout in the module note).
    """
    e = _check_inputs(x, tokens_per_expert, quantizers, states)
    states = list(states) if states is not None else [None] * e
    mult = multiple or token_multiple(*quantizers)
    offsets, poffsets = padded_offsets(tokens_per_expert, mult)
    splits = [int(v) for v in tokens_per_expert.tolist()]  # the reference's one host sync
    if sum(splits) != x.shape[0] or min(splits, default=0) < 0:
        raise ValueError(
            f"split_quantize: tokens_per_expert {splits} must be non-negative and sum to "
            f"x.shape[0] = {x.shape[0]}"
        )
    padded = [-(-m // mult) * mult for m in splits]
    rows, cols, start = [], [], 0
    x = x.detach()
    for i, (m, p) in enumerate(zip(splits, padded)):
        xe = pad_rows(x[start:start + m], p)
        r, c = quantizers[i].quantize_storages(xe, rowwise=rowwise, columnwise=columnwise, state=states[i])
        rows.append(r)
        cols.append(c)
        start += m
    return GroupedQuantized(rowwise=rows, columnwise=cols, splits=splits, padded_splits=padded,
                            offsets=offsets, padded_offsets=poffsets)


def _check_inputs(x, tokens_per_expert, quantizers, states) -> int:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"split_quantize expects x [T, K]; got {getattr(x, 'shape', type(x).__name__)}")
    if (not isinstance(tokens_per_expert, torch.Tensor) or tokens_per_expert.dim() != 1
            or tokens_per_expert.is_floating_point()):
        raise ValueError(
            "split_quantize expects tokens_per_expert as a 1D int tensor [E]; got "
            f"{getattr(tokens_per_expert, 'dtype', type(tokens_per_expert).__name__)}"
        )
    if tokens_per_expert.device != x.device:
        raise ValueError(
            f"tokens_per_expert is on {tokens_per_expert.device} but x is on {x.device}; keep "
            "it on x's device (no host copy needed)"
        )
    e = tokens_per_expert.shape[0]
    if len(quantizers) != e or (states is not None and len(states) != e):
        raise ValueError(
            f"split_quantize: {e} experts but {len(quantizers)} quantizers and "
            f"{None if states is None else len(states)} states; pass one per expert"
        )
    return e
