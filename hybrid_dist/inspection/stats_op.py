"""``quant_stats`` of one statistics row as one opaque operator.

A logging step computes a few dozen small reductions per row (norms, counts, a histogram)
and, for a candidate row, a quantize in another format. Traced into a compiled block, they
would become Inductor's to schedule and generate code for: hundreds of kernels compiled for
a graph that runs once every N steps, longer to compile than the training graph itself.
Here each row is one ``torch.library`` operator whose implementation runs the same torch
code eagerly; a compiled graph records one opaque call per row, Inductor generates nothing
for it, and eager calls give the same bits.

* ``storage_stats``: a row of the format the GEMM used. The storage travels as its tensor
  fields plus a string of its class and metadata (``storage_spec``); the implementation
  rebuilds it.
* ``candidate_stats``: a candidate row: quantize ``x2d`` in one direction with
  ``CANDIDATES[candidate][tensor_type]``, then its statistics.
"""

from __future__ import annotations

import ast
import functools

import torch

from hybrid_dist import formats
from hybrid_dist.formats import storage_meta_fields
from hybrid_dist.inspection.candidates import CANDIDATES
from hybrid_dist.inspection.stats import WIDTH, quant_stats
from hybrid_dist.library_op import library_op


def storage_spec(storage) -> str:
    """``"Class:name=value,..."``: ``storage``'s class (exported by ``hybrid_dist.formats``)
    and its metadata (bools, ints, None), everything but the tensor fields. Built from
    static values only, so tracing it records nothing."""
    meta = storage_meta_fields(storage)
    for name, value in meta.items():
        if value is not None and type(value) not in (bool, int):
            raise TypeError(f"storage_stats: metadata {name}={value!r} of {type(storage).__name__} is not a "
                            "bool, int or None")
    return type(storage).__name__ + ":" + ",".join(f"{k}={meta[k]!r}" for k in sorted(meta))


@functools.cache
def _storage_class_and_meta(spec: str) -> tuple[type, dict]:
    name, _, items = spec.partition(":")
    cls = getattr(formats, name, None)
    if not (isinstance(cls, type) and issubclass(cls, formats.DirectionStorage)):
        raise ValueError(f"storage_stats: {name!r} is not a storage class of hybrid_dist.formats")
    meta = {k: ast.literal_eval(v) for k, v in (item.split("=") for item in items.split(",") if item)}
    return cls, meta


def storages_from_spec(spec: str, fields: list[torch.Tensor]) -> list:
    """The storages of class and metadata ``spec`` (``storage_spec``) whose tensor fields are
    ``fields``, in order: one storage per ``len(TENSOR_FIELDS)`` tensors."""
    cls, meta = _storage_class_and_meta(spec)
    n = len(cls.TENSOR_FIELDS)
    return [cls(**meta, **dict(zip(cls.TENSOR_FIELDS, fields[i:i + n]))) for i in range(0, len(fields), n)]


@library_op("hybrid_dist::storage_stats")
def storage_stats_op(x2d: torch.Tensor | None, fields: list[torch.Tensor], spec: str,
                     sharded: bool) -> torch.Tensor:
    """``quant_stats(x2d, storage, sharded=sharded)`` of the storage ``spec`` + ``fields``."""
    (storage,) = storages_from_spec(spec, fields)
    return quant_stats(x2d, storage, sharded=sharded)


@storage_stats_op.register_fake
def _(x2d, fields, spec, sharded):
    return fields[0].new_empty(WIDTH, dtype=torch.float64)


@library_op("hybrid_dist::candidate_stats")
def candidate_stats_op(x2d: torch.Tensor, candidate: str, tensor_type: str, direction: str,
                       sharded: bool) -> torch.Tensor:
    """``quant_stats`` of ``x2d`` quantized in ``direction`` by ``CANDIDATES[candidate][tensor_type]``."""
    q = CANDIDATES[candidate][tensor_type]
    row, col = q.quantize_storages(x2d, rowwise=direction == "rowwise", columnwise=direction == "columnwise")
    return quant_stats(x2d, row if row is not None else col, sharded=sharded)


@candidate_stats_op.register_fake
def _(x2d, candidate, tensor_type, direction, sharded):
    return x2d.new_empty(WIDTH, dtype=torch.float64)


def storage_stats(x2d: torch.Tensor | None, storage, *, sharded: bool = False) -> torch.Tensor:
    """float64 ``[WIDTH]``: ``quant_stats`` of ``storage`` against ``x2d``, as one operator."""
    fields = [getattr(storage, f) for f in type(storage).TENSOR_FIELDS]
    return storage_stats_op(x2d, fields, storage_spec(storage), sharded)


def candidate_stats(x2d: torch.Tensor, candidate: str, tensor_type: str, direction: str, *,
                    sharded: bool = False) -> torch.Tensor:
    """float64 ``[WIDTH]``: ``quant_stats`` of a candidate format's ``direction`` of ``x2d``."""
    return candidate_stats_op(x2d, candidate, tensor_type, direction, sharded)
