"""``gather_along_first_dim`` (quantized or not) and ``reduce_scatter_along_first_dim``.

A local shard ``x [d0, *, K]`` of a tensor split along dim 0 over a TP group is viewed as
2D ``[M_local, K]`` (``M_local = numel / K``); gathering dim 0 concatenates these views in
rank order, so the gathered ``[M, K]`` is their row concatenation (seq-first layouts such
as ``[S, B, H]`` shard S). With a quantizer there are two paths:

(a) ``"high_precision"``: all-gather ``x``, then quantize the requested directions of the
    gathered tensor (always valid; 2–4 bytes per element on the wire);
(b) ``"quantized"``: quantize the local shard, all-gather each requested direction's
    buffers (rowwise stored ``[M, K]`` gathers along rows, columnwise stored ``[K, M]``
    along columns: the axes come from each storage's ``field_axes()``), all fields of all
    directions in one collective. Where the columnwise direction is the rowwise one
    transposed (one per-tensor FP8 quantizer for both, ``hybrid_dist.derived_columnwise``)
    the rowwise bytes travel (also when only the columnwise is asked for: they are its
    transport layout) and the columnwise is the gathered rows transposed.

[Note: when (a) and (b) agree bitwise]
* Per-tensor scales (FP8, NVFP4's fp32 scale): the shard amaxes are all-reduced (MAX)
  first, so every rank uses the full tensor's amax (max is exact). NVFP4 ``rht=True``
  columnwise uses the amax of the Hadamard-transformed tensor; it is reduced too (the
  transform acts on 16-row blocks, which a shard never splits).
* Block formats: blocks along dim 0 (the columnwise direction of 1D-block formats, both
  directions of 128×128 FP8 and NVFP4 2D) must not straddle shards: ``M_local`` must be a
  multiple of the block's rows. Otherwise path (a) is taken, with a one-time warning.
* Delayed scaling: the reduced amax is recorded in the state, so every rank's history
  equals the single-process one.
* Stochastic rounding draws its random numbers per call: path (b) rounds each shard with
  the rank's own generator, path (a) rounds the gathered tensor. Scales (block and
  per-tensor) are bitwise equal; each element lands on one of the same two neighbouring
  E2M1 values, but the choice may differ. Bitwise equality holds only without SR.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from hybrid_dist.amax_sync import all_reduce_amaxes
from hybrid_dist.derived_columnwise import derivable_columnwise, derive_columnwise
from hybrid_dist.warn import warn_once

from hybrid_dist.formats import Quantizer, tensor_amax
from hybrid_dist.formats.identity import IdentityQuantizer
from hybrid_dist.formats.nvfp4 import NVFP4Quantizer
from hybrid_dist.quantized_tensor import QuantizedTensor

from hybrid_dist.tensor_parallel import _comm

PATHS = ("auto", "quantized", "high_precision")


def _warn_once(msg: str) -> None:
    warn_once(msg, stacklevel=4)


def _directions(rowwise: bool, columnwise: bool) -> list[str]:
    dirs = [d for d, want in (("rowwise", rowwise), ("columnwise", columnwise)) if want]
    if not dirs:
        raise ValueError("gather_along_first_dim: ask for at least one of rowwise / columnwise")
    return dirs


def _is_rht_col(q: Quantizer, direction: str) -> bool:
    dq = q.direction_quantizer(direction)
    return direction == "columnwise" and isinstance(dq, NVFP4Quantizer) and dq.rht


def quantized_path_blocker(quantizer: Quantizer, m_local: int, directions: list[str]) -> str | None:
    """Why path (b) cannot be bitwise equal to path (a) for this shard, or None."""
    for d in directions:
        bm, _ = quantizer.direction_quantizer(d).block_shape(d)
        if m_local % bm:
            return (f"{type(quantizer.direction_quantizer(d)).__name__} {d} blocks span {bm} rows "
                    f"along dim 0 but the local shard has {m_local} rows (not a multiple), so "
                    f"blocks would straddle ranks; all-gathering in high precision instead. Make "
                    f"the per-rank rows (prod of leading dims) a multiple of {bm} to gather quantized.")
    return None


# --- quantize a shard with group-reduced amaxes (stage 1 of path b) ---------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardRequest:
    """One sharded tensor to quantize with the group's amax: ``x2d [rows, K]``."""

    quantizer: Quantizer
    x2d: torch.Tensor
    rowwise: bool
    columnwise: bool
    state: Any = None

    def local_amaxes(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(plain amax, Hadamard-domain columnwise amax) this shard contributes, or None
        where no requested direction has a per-tensor scale of that kind."""
        dirs = _directions(self.rowwise, self.columnwise)
        rht_col = "columnwise" in dirs and _is_rht_col(self.quantizer, "columnwise")
        plain = any(self.quantizer.direction_quantizer(d).is_per_tensor
                    for d in dirs if not (d == "columnwise" and rht_col))
        col_q = self.quantizer.direction_quantizer("columnwise")
        return (tensor_amax(self.x2d) if plain else None,
                col_q.columnwise_rht_amax(self.x2d) if rht_col else None)

    def quantize(self, amax, rht_amax):
        q, x2d, state = self.quantizer, self.x2d, self.state
        if rht_amax is None:
            return q.quantize_storages(x2d, rowwise=self.rowwise, columnwise=self.columnwise, state=state, amax=amax)
        row = None
        if self.rowwise:  # same generator order as one call: rowwise first, then columnwise
            row, _ = q.quantize_storages(x2d, rowwise=True, columnwise=False, state=state, amax=amax)
        col = q.direction_quantizer("columnwise").quantize_columnwise_rht(
            x2d, amax=amax, rht_amax=rht_amax, state=q.direction_state(state, "columnwise"))
        return row, col


def quantize_shards_with_group_amax(requests: list[ShardRequest], group) -> list[tuple]:
    """``(row, col)`` storages per request, each quantized with the amax(es) of the whole
    group's tensor: **one** MAX all-reduce for all requests (none when no requested
    direction has a per-tensor scale). ``group=None`` or size 1: local amaxes."""
    local = [r.local_amaxes() for r in requests]
    vals = [a for pair in local for a in pair if a is not None]
    if vals and group is not None and _comm.group_size(group) > 1:
        buf = all_reduce_amaxes(vals, [group])
        _comm.log_event("all_reduce", "amax", "float32", buf.numel() * buf.element_size())
        reduced = iter(buf.unbind(0))
        local = [tuple(None if a is None else next(reduced) for a in pair) for pair in local]
    elif vals:  # no group: quantize with the local values (what quantize computes itself)
        local = [(None, rht) for _, rht in local]
    return [r.quantize(amax, rht) for r, (amax, rht) in zip(requests, local)]


def quantize_with_group_amax(quantizer: Quantizer, x2d: torch.Tensor, group, *, rowwise: bool,
                             columnwise: bool, state=None):
    """``(row, col)`` storages of the shard ``x2d [M_local, K]`` quantized with the
    amax(es) of the whole group's tensor (see ``quantize_shards_with_group_amax``)."""
    req = ShardRequest(quantizer=quantizer, x2d=x2d, rowwise=rowwise, columnwise=columnwise, state=state)
    return quantize_shards_with_group_amax([req], group)[0]


# --- gather quantized storages (stage 2 of path b) ------------------------------------------
def gather_storages(storages: dict, group, *, async_op: bool = False):
    """All-gather local storages ``{direction: DirectionStorage}`` along the logical dim 0
    in one collective. Returns ``{direction: gathered storage}`` (or a handle)."""
    world = _comm.group_size(group)
    fields, owners = [], []
    for d, st in storages.items():
        key = "C" if st.transposed else "R"
        for f, t in st.tensors().items():
            ax = st.field_axes()[f].get(key)
            if ax is not None:  # per-tensor fields are equal on all ranks: not sent
                fields.append((t, ax[0]))
                owners.append((d, f))
    flat, specs = _comm.pack_fields(fields)
    for d, st in storages.items():
        nbytes = sum(sp.nbytes for sp, (dd, _) in zip(specs, owners) if dd == d)
        _comm.log_event("all_gather", d, st.FORMAT, nbytes * world)
    work, out = _comm.all_gather_dim0(flat, group, async_op=async_op)

    def finish():
        gathered = dict(zip(owners, _comm.unpack_gathered(out, specs, world)))
        return {d: st.with_tensors({f: gathered.get((d, f), t) for f, t in st.tensors().items()})
                for d, st in storages.items()}

    return _comm.finish_or_handle(work, finish, async_op)


# --- public ------------------------------------------------------------------------------
def gather_along_first_dim(x: torch.Tensor, group, *, quantizer: Quantizer | None = None,
                           rowwise: bool = True, columnwise: bool = False, async_op: bool = False,
                           state=None, path: str = "auto"):
    """All-gather ``x [d0, *, K]`` along dim 0 over ``group`` → ``[world·d0, *, K]``.

    Without ``quantizer``: a plain tensor. With one: a :class:`QuantizedTensor` holding the
    requested directions, bitwise equal to quantizing the gathered tensor (module note).
    ``path``: ``"auto"`` (quantized where valid, else high precision with a one-time
    warning; high precision also when every requested direction is an identity format,
    which would otherwise send the same bytes once per direction), ``"quantized"`` (raise
    where invalid) or ``"high_precision"``. ``state``: the quantizer state (delayed
    scaling, SR generator). ``async_op=True`` returns a :class:`CollectiveHandle` whose
    ``wait()`` returns the result. Not differentiable (``x`` is detached): training goes
    through the ``ParallelStyle``s, whose autograd functions call this.
    """
    if path not in PATHS:
        raise ValueError(f"gather_along_first_dim: path must be one of {PATHS}, got {path!r}")
    world = _comm.group_size(group)
    if quantizer is None:
        _comm.log_event("all_gather", "high_precision", str(x.dtype), x.numel() * x.element_size() * world)
        work, out = _comm.all_gather_dim0(x, group, async_op=async_op)
        return _comm.finish_or_handle(work, lambda: out, async_op)
    full_shape = (world * x.shape[0], *x.shape[1:])

    def wrap(storages):
        return QuantizedTensor(full_shape, x.dtype, storages[0], storages[1], quantizer)

    res = gather_storages_along_first_dim(x, group, quantizer, rowwise=rowwise, columnwise=columnwise,
                                          async_op=async_op, state=state, path=path)
    if async_op:
        return _comm.CollectiveHandle(res, lambda: wrap(res.wait()))  # res.wait() via the handle
    return wrap(res)


def gather_storages_along_first_dim(x: torch.Tensor, group, quantizer: Quantizer, *, rowwise: bool,
                                    columnwise: bool, async_op: bool = False, state=None, path: str = "auto"):
    """``gather_along_first_dim`` with a quantizer, as the ``(rowwise, columnwise)`` storages
    of the gathered tensor (None where not asked for) instead of a ``QuantizedTensor``: what
    traced code reads (Dynamo cannot read the attributes of a ``QuantizedTensor`` made inside
    the graph)."""
    world = _comm.group_size(group)
    dirs = _directions(rowwise, columnwise)
    k = x.shape[-1]
    m_local = x.numel() // k if k else 0
    for d in dirs:  # the blocks apply to the gathered tensor
        quantizer.direction_quantizer(d).check_shape(world * m_local, k, d)
    blocker = quantized_path_blocker(quantizer, m_local, dirs)
    if path == "quantized" and blocker:
        raise ValueError(f"gather_along_first_dim(path='quantized'): {blocker}")
    if path == "auto" and blocker:
        _warn_once(blocker)
    x2d = x.detach().reshape(m_local, k)
    # all directions high precision: (b) would send the same bytes once per direction
    all_identity = all(isinstance(quantizer.direction_quantizer(d), IdentityQuantizer) for d in dirs)
    if path == "high_precision" or blocker or (path == "auto" and all_identity):
        return _gather_then_quantize(x2d, group, quantizer, rowwise, columnwise, state, async_op)
    derive = columnwise and derivable_columnwise(quantizer)  # gather the rowwise bytes, transpose after
    row, col = quantize_with_group_amax(quantizer, x2d, group, rowwise=rowwise or derive,
                                        columnwise=columnwise and not derive, state=state)
    local = {d: st for d, st in (("rowwise", row), ("columnwise", col)) if st is not None}
    res = gather_storages(local, group, async_op=async_op)

    def pair(g):
        row = g.get("rowwise")
        col = derive_columnwise(row) if derive else g.get("columnwise")
        return (row if rowwise else None), col

    if async_op:
        return _comm.CollectiveHandle(res, lambda: pair(res.wait()))
    return pair(res)


def _gather_then_quantize(x2d, group, quantizer, rowwise, columnwise, state, async_op):
    world = _comm.group_size(group)
    _comm.log_event("all_gather", "high_precision", str(x2d.dtype), x2d.numel() * x2d.element_size() * world)
    work, out = _comm.all_gather_dim0(x2d, group, async_op=async_op)

    def finish():
        return quantizer.quantize_storages(out, rowwise=rowwise, columnwise=columnwise, state=state)

    return _comm.finish_or_handle(work, finish, async_op)


def all_reduce_sum(x: torch.Tensor, group, *, async_op: bool = False):
    """Sum a partial result ``x`` over ``group`` (high precision: a row-parallel output, a
    replicated input's gradient). ``async_op=True`` returns a :class:`CollectiveHandle`."""
    _comm.log_event("all_reduce", "partial_sum", str(x.dtype), x.numel() * x.element_size())
    work, out = _comm.all_reduce(x.contiguous(), group, async_op=async_op)
    return _comm.finish_or_handle(work, lambda: out, async_op)


def reduce_scatter_along_first_dim(x: torch.Tensor, group, *, async_op: bool = False):
    """Sum ``x [world·d, *]`` over ``group`` and keep this rank's ``[d, *]`` slice (high
    precision; sequence-parallel outputs and input gradients)."""
    _comm.log_event("reduce_scatter", "high_precision", str(x.dtype), x.numel() * x.element_size())
    work, out = _comm.reduce_scatter_dim0(x, group, async_op=async_op)
    return _comm.finish_or_handle(work, lambda: out, async_op)
