"""Saving quantized operands for backward as plain tensors.

``ctx.save_for_backward`` sees only the storages' plain tensors (uint8/fp8/fp32), so
``torch.autograd.graph.save_on_cpu`` moves them bitwise and activation recompute works;
the storage structure travels beside them as metadata.
"""

from __future__ import annotations

from hybrid_dist.formats._storage import DirectionStorage, storage_meta_fields


def pack(ctx, *storages: DirectionStorage | None) -> None:
    tensors, layout = [], []
    for st in storages:
        if st is None:
            layout.append(None)
            continue
        fields = st.tensors()
        # metadata only: holding ``st`` itself would keep its device tensors alive
        layout.append((type(st), storage_meta_fields(st), tuple(fields)))
        tensors.extend(fields.values())
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
