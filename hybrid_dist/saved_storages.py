"""Saving quantized operands for backward as plain tensors.

``ctx.save_for_backward`` sees only the storages' plain tensors (uint8/fp8/fp32), so
``torch.autograd.graph.save_on_cpu`` moves them bitwise and activation recompute works;
the storage structure travels beside them as metadata.
"""

from __future__ import annotations

import dataclasses

import torch

from hybrid_dist.formats._storage import DirectionStorage

_META_NAMES: dict[type, tuple[str, ...]] = {}  # storage class -> its non-tensor field names


def _meta_names(st: DirectionStorage) -> tuple[str, ...]:
    cls = type(st)
    if torch.compiler.is_compiling():  # the cache is eager's: reading it would guard a graph on its contents
        return tuple(f.name for f in dataclasses.fields(st) if f.name not in cls.TENSOR_FIELDS)
    names = _META_NAMES.get(cls)
    if names is None:
        names = _META_NAMES[cls] = tuple(f.name for f in dataclasses.fields(st) if f.name not in cls.TENSOR_FIELDS)
    return names


def pack(ctx, *storages: DirectionStorage | None) -> None:
    tensors, layout = [], []
    for st in storages:
        if st is None:
            layout.append(None)
            continue
        cls = type(st)
        # metadata only: holding ``st`` itself would keep its device tensors alive
        layout.append((cls, {m: getattr(st, m) for m in _meta_names(st)}, cls.TENSOR_FIELDS))
        tensors += [getattr(st, f) for f in cls.TENSOR_FIELDS]
    ctx.save_for_backward(*tensors)
    ctx.hd_layout = layout


def unpack(ctx) -> list[DirectionStorage | None]:
    it = iter(ctx.saved_tensors)
    out = []
    for entry in ctx.hd_layout:
        if entry is None:
            out.append(None)
            continue
        cls, meta, names = entry
        out.append(cls(**meta, **{n: next(it) for n in names}))
    return out
