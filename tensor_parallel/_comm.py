"""Low-level collectives of the TP package: byte-packed all-gathers, reduce-scatters,
amax all-reduces, async handles and the bytes-on-the-wire log.

[Note: one collective per gather]
A quantized all-gather moves several tensors (codes, block scales; per direction). They
are packed into **one** flat ``uint8`` buffer per rank (each field moved so that its
logical-dim-0 axis is first, then viewed as bytes) and gathered with a single
``all_gather_single``/``all_gather_into_tensor``; the receiver unpacks each rank's slice
and concatenates along the field's own axis. Viewing as bytes also lets backends without
fp8 support (gloo) carry fp8 payloads.

[Note: collectives under torch.compile]
Dynamo cannot trace c10d's ``async_op=True`` calls (each one is a graph break). While
compiling, the primitives below issue functional collectives
(``torch.distributed._functional_collectives``) instead: they return their output, the
graph waits where it is used, and inductor may overlap them with compute. Eager code keeps
the c10d calls and their async handles.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from hybrid_dist.all_reduce import all_reduce  # noqa: F401  (the TP SUMs, traceable)
from hybrid_dist.kernels import transposed_2d

# torch >= 2.13 names them *_single; 2.11 has only the *_tensor spelling.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# --- bytes-on-the-wire log ----------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class WireEvent:
    """One collective's payload. ``nbytes`` = bytes of the gathered output (all_gather),
    of the full input (reduce_scatter) or of the reduced tensor (all_reduce)."""

    kind: str  # "all_gather" | "reduce_scatter" | "all_reduce"
    what: str  # "rowwise" | "columnwise" | "high_precision" | "amax" | "grad" | "output" | ...
    fmt: str  # storage format ("fp8", "mxfp8", "nvfp4", ...) or the dtype name
    nbytes: int


@dataclasses.dataclass
class WireLog:
    """Events recorded inside ``record_wire_bytes()`` (this process, in call order)."""

    events: list[WireEvent] = dataclasses.field(default_factory=list)

    def total(self, kind: str | None = None, what: str | None = None) -> int:
        return sum(e.nbytes for e in self.events
                   if (kind is None or e.kind == kind) and (what is None or e.what == what))


_ACTIVE: list[WireLog] = []  # the open record_wire_bytes() logs, innermost last


@contextlib.contextmanager
def record_wire_bytes():
    """Record the payload of every TP collective run inside the block::

        with record_wire_bytes() as log:
            gather_along_first_dim(x, group, quantizer=q)
        log.total("all_gather", "rowwise")

    Process-wide: collectives issued from other threads while the block is open are
    recorded too (on CUDA, autograd runs the backward on its own device thread). Compiled
    code records nothing."""
    log = WireLog()
    _ACTIVE.append(log)
    try:
        yield log
    finally:
        _ACTIVE.remove(log)


def log_event(kind: str, what: str, fmt: str, nbytes: int) -> None:
    """Record one collective in the innermost open log. Not while compiling (a traced
    region records nothing: measure bytes on an eager step)."""
    if _ACTIVE and not torch.compiler.is_compiling():
        _ACTIVE[-1].events.append(WireEvent(kind=kind, what=what, fmt=fmt, nbytes=int(nbytes)))


# --- async handle ---------------------------------------------------------------------
class CollectiveHandle:
    """Result of an ``async_op=True`` call: ``wait()`` finishes the collective (and any
    unpacking / quantization after it) and returns the result; calling it again returns
    the same object."""

    def __init__(self, work, finish: Callable[[], object]):
        self._work = work
        self._finish = finish
        self._result = None
        self._done = False

    def wait(self):
        if not self._done:
            if self._work is not None:
                self._work.wait()
            self._result = self._finish()
            self._done = True
            self._finish = None
        return self._result


def finish_or_handle(work, finish: Callable[[], object], async_op: bool):
    if async_op:
        return CollectiveHandle(work, finish)
    if work is not None:
        work.wait()
    return finish()


# --- primitives -------------------------------------------------------------------------
def group_size(group) -> int:
    return dist.get_world_size(group)


def all_gather_dim0(x: torch.Tensor, group, *, async_op: bool = False):
    """All-gather ``x`` along dim 0: ``[d0, *rest]`` → ``[world·d0, *rest]`` (rank order).
    Returns ``(work or None, output)``; the output is valid after ``work.wait()``. While
    compiling: a functional collective (note "collectives under torch.compile"), work None."""
    world = group_size(group)
    x = x.contiguous()
    as_bytes = x.dtype.itemsize == 1 and x.dtype.is_floating_point  # fp8: carried as bytes
    if torch.compiler.is_compiling():
        out = funcol.all_gather_tensor(x.view(torch.uint8) if as_bytes else x, 0, group)
        return None, out.view(x.dtype) if as_bytes else out
    out = x.new_empty((world * x.shape[0], *x.shape[1:]))
    if as_bytes:
        work = _all_gather_single(out.view(torch.uint8), x.view(torch.uint8), group=group, async_op=async_op)
    else:
        work = _all_gather_single(out, x, group=group, async_op=async_op)
    return work, out


def reduce_scatter_dim0(x: torch.Tensor, group, *, async_op: bool = False):
    """Sum over ranks and scatter along dim 0: ``[world·d, *rest]`` → ``[d, *rest]``."""
    world = group_size(group)
    if x.shape[0] % world:
        raise ValueError(
            f"reduce_scatter_along_first_dim: dim 0 has size {x.shape[0]}, not a multiple of "
            f"the group size {world}. Pad the sequence to a multiple of {world}."
        )
    x = x.contiguous()
    if torch.compiler.is_compiling():
        return None, funcol.reduce_scatter_tensor(x, "sum", 0, group)
    out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
    work = _reduce_scatter_single(out, x, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return work, out


# --- byte packing -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _FieldSpec:
    dtype: torch.dtype
    moved_shape: tuple[int, ...]  # shape with the gathered axis first
    axis: int
    nbytes: int


def pack_fields(fields: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, list[_FieldSpec]]:
    """``[(tensor, axis)]`` → (flat uint8 buffer, specs). ``axis`` is the dim gathered."""
    parts, specs = [], []
    for t, axis in fields:
        moved = transposed_2d(t) if axis == 1 and t.dim() == 2 else t.movedim(axis, 0).contiguous()
        raw = moved.reshape(-1).view(torch.uint8) if moved.numel() else moved.new_empty(0, dtype=torch.uint8)
        parts.append(raw)
        specs.append(_FieldSpec(t.dtype, tuple(moved.shape), axis, raw.numel()))
    if len(parts) == 1:  # one field (per-tensor FP8 data): gathered as it is, no packing copy
        return parts[0], specs
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return flat, specs


def unpack_gathered(out: torch.Tensor, specs: list[_FieldSpec], world: int) -> list[torch.Tensor]:
    """Inverse of ``pack_fields`` after an all-gather: each field concatenated over ranks
    along its axis."""
    per_rank = out.view(world, -1)
    result = []
    offset = 0
    for sp in specs:
        chunk = per_rank[:, offset:offset + sp.nbytes].contiguous()
        offset += sp.nbytes
        # [world, n_axis, *rest] → [world·n_axis, *rest] is the concatenation over ranks
        vals = chunk.view(sp.dtype).reshape(world * sp.moved_shape[0], *sp.moved_shape[1:])
        # the 2D transposed copy (a columnwise storage gathered along its token axis) by the kernel
        result.append(transposed_2d(vals) if sp.axis == 1 and vals.dim() == 2
                      else vals.movedim(0, sp.axis).contiguous())
    return result
