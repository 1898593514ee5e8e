"""The index space of the packed per-expert layout (``device_split``), built once per step.

For ``tokens_per_expert [E]`` over T rows sorted by expert and a padding multiple b:

    capacity  C = ceil((T + E·(b-1)) / g) · g          static bound on Σ p_e, p_e = ⌈m_e/b⌉·b,
                                                       g = lcm(b, CAPACITY_ROWS)
    off, poff [E+1]                                    cumulative token / padded counts
    eid  [T]    = repeat_interleave(arange(E), m)      expert of each row
    dest [T]    = arange(T) - off[eid] + poff[eid]     padded row of each row
    row_expert [C]                                     expert of each padded row (E past the last)

All from shapes known on the host and device arithmetic: no device-to-host sync. C is a
multiple of ``CAPACITY_ROWS`` (128) as well: kernels over the whole packed buffer pick a form
by its row count (MXFP8's columnwise words kernel runs unmasked, its scales staged, where
C is a multiple of its tile rows), and one row class whatever the routing keeps them from
compiling a second form mid-run (``tests_distributed/test_moe_ep_recompile.py``). On CUDA
outside a traced graph one Triton launch computes all five (``kernels.packed_index``,
bitwise the torch form); compiled graphs and the CPU use the torch form.

One MoE layer's grouped GEMMs quantize four tensors over the same received rows (x, the
hidden activation, and the two output gradients); :class:`IndexCache` builds the index
once per padding multiple for all of them (the expert-parallel ``Route`` holds one).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from hybrid_dist.kernels import kernels_serve
from hybrid_dist.moe.split_quantize import padded_offsets

__all__ = ["IndexCache", "PackedIndex", "packed_capacity", "packed_index"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackedIndex:
    """The packed layout's index tensors (module doc), int64 on the counts' device."""

    offsets: torch.Tensor
    padded_offsets: torch.Tensor
    eid: torch.Tensor
    dest: torch.Tensor
    row_expert: torch.Tensor
    rows: int
    capacity: int
    multiple: int


CAPACITY_ROWS = 128  # the tile rows of MXFP8's default columnwise words kernel (``kernels.mxfp8.configs``)


def packed_capacity(rows: int, num_experts: int, multiple: int) -> int:
    """``C``: the padded rows' static bound for ``rows`` tokens over ``num_experts`` experts,
    rounded up to a multiple of ``CAPACITY_ROWS`` too (module doc)."""
    granule = math.lcm(multiple, CAPACITY_ROWS)
    return -(-(rows + num_experts * (multiple - 1)) // granule) * granule


def packed_index(tokens_per_expert: torch.Tensor, rows: int, multiple: int) -> PackedIndex:
    """The index of ``tokens_per_expert [E]`` (summing to ``rows``, on the rows' device)
    padded to ``multiple`` (module doc)."""
    e = tokens_per_expert.numel()
    cap = packed_capacity(rows, e, multiple)
    if kernels_serve(tokens_per_expert):
        from hybrid_dist.kernels.packed_index import packed_index as fused

        off, poff, eid, dest, row_expert = fused(tokens_per_expert, rows, cap, multiple)
    else:
        off, poff = padded_offsets(tokens_per_expert, multiple)
        dev = tokens_per_expert.device
        eid = torch.repeat_interleave(torch.arange(e, device=dev), tokens_per_expert, output_size=rows)
        dest = torch.arange(rows, device=dev) - off[eid] + poff[eid]
        # expert of each padded row, E past the last expert: repeat_interleave, not searchsorted
        # (inductor's CUDA codegen of ``searchsorted(poff[1:], ...)`` dropped the slice's
        # offset, torch 2.11: every row one expert late)
        seg = torch.cat([poff.diff(), cap - poff[-1:]])
        row_expert = torch.repeat_interleave(torch.arange(e + 1, device=dev), seg, output_size=cap)
    return PackedIndex(offsets=off, padded_offsets=poff, eid=eid, dest=dest, row_expert=row_expert, rows=rows,
                       capacity=cap, multiple=multiple)


class IndexCache:
    """:func:`packed_index` of one ``tokens_per_expert`` over ``rows`` rows, built on first
    use per padding multiple and kept. The counts must not change while it is in use."""

    __slots__ = ("tokens_per_expert", "rows", "_built")

    def __init__(self, tokens_per_expert: torch.Tensor, rows: int):
        self.tokens_per_expert, self.rows, self._built = tokens_per_expert, rows, {}

    def get(self, multiple: int) -> PackedIndex:
        index = self._built.get(multiple)
        if index is None:
            index = self._built[multiple] = packed_index(self.tokens_per_expert, self.rows, multiple)
        return index

    def serves(self, tokens_per_expert: torch.Tensor, rows: int) -> bool:
        """Whether this cache indexes these counts (the same tensor) over ``rows`` rows."""
        return tokens_per_expert is self.tokens_per_expert and rows == self.rows

    @staticmethod
    def serving(cache: "IndexCache | None", tokens_per_expert: torch.Tensor, rows: int) -> "IndexCache | None":
        """``cache`` if it serves these counts over ``rows`` rows (its owner made the counts,
        so a caller need not check them again), else None."""
        return cache if cache is not None and cache.serves(tokens_per_expert, rows) else None
