"""Capturing statistics inside the GEMM functions, only while ``capturing()`` is active.

[Note: statistics cost nothing when off]
A GEMM function (``hd.Linear``'s, the tensor-parallel ones, ``GroupedLinear``'s:
``record_experts``) asks ``active_stats(plan)``
right after it quantizes an operand. That is a read of a process-wide flag and of the
plan's ``stats`` attribute: no hook is installed, no op runs and nothing is allocated
unless both are set. Inside ``capturing()`` the function passes the high-precision tensor
and the storages its GEMMs use to ``ModuleStats.record``, which writes one row of
``quant_stats`` per (tensor type, direction, format) into a preallocated device buffer, in
place: no host sync, and traceable, so a ``torch.compile``d block traces the capture with
no graph break (each row is one opaque operator, ``stats_op``, so Inductor compiles nothing
for it) (Dynamo guards on the flag: a compiled block keeps one graph without
statistics and one with). Backward reads ``ctx.stats``, set in forward, so gradients are
captured for exactly the forwards that were. The buffers are read by the host once per
logging step (``StatsCollector.read``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from hybrid_dist.inspection.candidates import CANDIDATES, GEMM_OF, fits, format_label
from hybrid_dist.inspection.expert_stats import expert_candidate_stats, expert_storage_stats
from hybrid_dist.inspection.stats import WIDTH
from hybrid_dist.inspection.stats_op import candidate_stats, storage_stats
from hybrid_dist.quantized_tensor import QuantizedTensor

_CAPTURING = [False]  # process-wide (autograd may run backward on another thread); traces guard on it


@contextlib.contextmanager
def capturing() -> Iterator[None]:
    """GEMM functions of modules with attached ``ModuleStats`` record statistics inside."""
    prev = _CAPTURING[0]
    _CAPTURING[0] = True
    try:
        yield
    finally:
        _CAPTURING[0] = prev


def is_capturing() -> bool:
    """Whether a logging step is capturing statistics (``capturing()``)."""
    return _CAPTURING[0]


def active_stats(plan) -> "ModuleStats | None":
    """``plan.stats`` while capturing, else None (see the note)."""
    if not _CAPTURING[0]:
        return None
    return getattr(plan, "stats", None)


class ModuleStats:
    """One module's statistics buffer: a row per (tensor type, direction, format): the
    format its recipe uses, and each candidate (``CANDIDATES``) when ``candidates``.
    ``name``: the module's qualified name in the model."""

    def __init__(self, *, name: str, plan, device: torch.device, candidates: bool = True):
        self.name = name
        self.rows: list[tuple[str, str, str, bool]] = []  # (tensor_type, direction, format label, used)
        self.candidates: dict[tuple[str, str, str], str] = {}  # candidate rows -> CANDIDATES key
        for (tensor_type, direction) in GEMM_OF:
            used = format_label(getattr(plan, tensor_type), direction)
            self.rows.append((tensor_type, direction, used, True))
            for cand_name, cand in CANDIDATES.items() if candidates else ():
                label = format_label(cand[tensor_type], direction)
                if label != used:
                    self.rows.append((tensor_type, direction, label, False))
                    self.candidates[(tensor_type, direction, label)] = cand_name
        self.index = {row[:3]: i for i, row in enumerate(self.rows)}
        self.buf = torch.zeros(len(self.rows), WIDTH, dtype=torch.float64, device=device)  # why: one read per step

    def reset(self) -> None:
        """Mark every row unwritten (``numel`` 0) before a capture."""
        self.buf.zero_()

    def record(self, tensor_type: str, hp: torch.Tensor | None, row, col, *, sharded: bool = False) -> None:
        """Statistics of the directions ``row`` / ``col`` (storages or None) a GEMM uses
        for ``tensor_type``, against ``hp`` (None or a ``QuantizedTensor``: no reference),
        and of each candidate format quantized from ``hp``. ``sharded``: ``hp`` is this
        rank's shard of the GEMM operand (tensor parallelism); the rows say so."""
        if isinstance(hp, QuantizedTensor):
            hp = None
        x2d = None if hp is None else (hp if hp.dim() == 2 else hp.reshape(-1, hp.shape[-1])).detach()
        for direction, st, key, cand in self._rows_for(tensor_type, row, col):
            if cand is None:
                self._write(key, storage_stats(x2d, st, sharded=sharded))
            elif x2d is not None and fits(CANDIDATES[cand][tensor_type], *x2d.shape, direction):
                self._write(key, candidate_stats(x2d, cand, tensor_type, direction, sharded=sharded))

    def record_experts(self, tensor_type: str, hp: torch.Tensor | None, row, col, *, num_experts: int,
                       offsets: torch.Tensor | None = None, poff: torch.Tensor | None = None) -> None:
        """``record`` for a grouped operand (``expert_stats``): ``row`` / ``col`` a list of
        storages (one packed, or one per expert) or None; ``hp [T, K]`` (or ``[E, N, K]``
        with ``offsets`` None: the weight; None or a ``QuantizedTensor``: no reference)
        split by ``offsets`` and zero-padded to ``poff``. One row per (direction, format)
        combines every expert's statistics; a candidate row, every expert's slice zero-padded
        to the candidate's blocks (experts whose other dim does not fit them are left out)."""
        if isinstance(hp, QuantizedTensor):
            hp = None
        x2d = None if hp is None else hp.reshape(-1, hp.shape[-1]).detach()
        seg = dict(num_experts=num_experts, offsets=offsets, poff=poff)
        for direction, sts, key, cand in self._rows_for(tensor_type, row, col):
            if cand is None:
                self._write(key, expert_storage_stats(x2d, sts, **seg))
            elif x2d is not None:
                self._write(key, expert_candidate_stats(x2d, cand, tensor_type, direction, **seg))

    def _rows_for(self, tensor_type: str, row, col) -> list[tuple]:
        """``(direction, storage, row key, candidate name or None for the used format)`` of
        each row of ``tensor_type`` in the directions given (``row`` / ``col`` not None)."""
        return [(d, st, (t, d, label), None if used else self.candidates[(t, d, label)])
                for d, st in (("rowwise", row), ("columnwise", col)) if st is not None
                for (t, dd, label, used) in self.rows if t == tensor_type and dd == d]

    def _write(self, key, vec: torch.Tensor) -> None:
        self.buf[self.index[key]].copy_(vec)
