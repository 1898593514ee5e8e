"""Forward all-gather of a sequence-parallel input and the wgrad operand it leaves behind.

[Note: the wgrad input under SP]
The forward needs the gathered input **rowwise** (fprop); the backward needs it gathered
**columnwise** (wgrad). Instead of saving the gathered tensor, the forward keeps only the
local shard — quantized columnwise with the group amax when path (b) is valid (or, where
the columnwise is the rowwise transposed, the rowwise shard it already made), else in high
precision — and the backward re-gathers it (quantized, or gather-then-quantize).
``WgradInput`` is that saved thing; ``start()`` launches the gather asynchronously so it
overlaps the dgrad GEMM.
"""

from __future__ import annotations

import torch

from hybrid_dist.derived_columnwise import derivable_columnwise, derive_columnwise
from hybrid_dist.formats import DirectionStorage
from hybrid_dist.formats.identity import IdentityStorage
from hybrid_dist.tensor_parallel import _comm
from hybrid_dist.tensor_parallel.gather import (
    ShardRequest,
    _warn_once,
    gather_storages,
    quantize_shards_with_group_amax,
    quantized_path_blocker,
)


class WgradInput:
    """The columnwise (wgrad) operand of an input, gathered on demand.

    kinds: ``"local"`` (not sequence parallel: the storage is already the full columnwise
    operand), ``"quantized"`` (local columnwise shard; backward all-gathers it),
    ``"derived"`` (local rowwise shard of a quantizer whose columnwise is the rowwise
    transposed, ``hybrid_dist.derived_columnwise``; backward all-gathers it and transposes),
    ``"high_precision"`` (local shard in high precision; backward all-gathers it and
    quantizes the result columnwise).
    """

    def __init__(self, kind: str, storage: DirectionStorage, *, group=None, quantizer=None, state=None):
        self.kind = kind
        self.storage = storage
        self.group, self.quantizer, self.state = group, quantizer, state

    def start(self) -> _comm.CollectiveHandle:
        """Begin the gather; ``.wait()`` returns the full columnwise storage ``[K, M]``."""
        if self.kind == "local":
            return _comm.CollectiveHandle(None, lambda: self.storage)
        if self.kind == "quantized":
            h = gather_storages({"columnwise": self.storage}, self.group, async_op=True)
            return _comm.CollectiveHandle(h, lambda: h.wait()["columnwise"])
        if self.kind == "derived":
            h = gather_storages({"rowwise": self.storage}, self.group, async_op=True)
            return _comm.CollectiveHandle(h, lambda: derive_columnwise(h.wait()["rowwise"]))
        x_local = self.storage.data
        world = _comm.group_size(self.group)
        _comm.log_event("all_gather", "high_precision", str(x_local.dtype),
                        x_local.numel() * x_local.element_size() * world)
        work, out = _comm.all_gather_dim0(x_local, self.group, async_op=True)

        def finish():
            _, col = self.quantizer.quantize_storages(out, rowwise=False, columnwise=True, state=self.state)
            return col

        return _comm.CollectiveHandle(work, finish)

    def meta(self) -> tuple:
        """Everything but the storage (the storage is saved for backward as tensors)."""
        return (self.kind, self.group, self.quantizer, self.state)

    @classmethod
    def from_meta(cls, meta: tuple, storage: DirectionStorage) -> "WgradInput":
        kind, group, quantizer, state = meta
        return cls(kind, storage, group=group, quantizer=quantizer, state=state)


def gather_input(x2d: torch.Tensor, group, quantizer, state, *, need_wgrad: bool, path: str = "auto",
                 extra: tuple[ShardRequest, ...] = ()):
    """Sequence-parallel input ``x2d [M_local, K]`` → ``(rowwise storage [M, K] gathered,
    WgradInput or None, results of extra)``. Per direction, path (b) where its blocks fit
    the shard and ``path`` allows it, else path (a) (one-time warning under ``"auto"``).
    ``extra``: other shards (the layer's weight) quantized with the group amax in the same
    all-reduce as this input's."""
    hp = path == "high_precision"
    m_local = x2d.shape[0]
    row_block = "high precision requested" if hp else quantized_path_blocker(quantizer, m_local, ["rowwise"])
    col_block = None
    if need_wgrad:
        col_block = "high precision requested" if hp else quantized_path_blocker(quantizer, m_local, ["columnwise"])
    for reason in (row_block, col_block):
        if reason and not hp:
            _warn_once(reason)
    want_row, want_col = not row_block, need_wgrad and not col_block
    derive = want_row and want_col and derivable_columnwise(quantizer)  # backward gathers the rowwise shard
    reqs = list(extra)
    if want_row or want_col:
        reqs.insert(0, ShardRequest(quantizer=quantizer, x2d=x2d, rowwise=want_row, columnwise=want_col and not derive,
                                    state=state))
    results = quantize_shards_with_group_amax(reqs, group)
    row_local, col_local = results.pop(0) if (want_row or want_col) else (None, None)
    if want_row:
        row = gather_storages({"rowwise": row_local}, group)["rowwise"]
    else:
        world = _comm.group_size(group)
        _comm.log_event("all_gather", "high_precision", str(x2d.dtype), x2d.numel() * x2d.element_size() * world)
        _, full = _comm.all_gather_dim0(x2d, group)
        row, _ = quantizer.quantize_storages(full, rowwise=True, columnwise=False, state=state)
    if not need_wgrad:
        return row, None, results
    if derive:
        return row, WgradInput("derived", row_local, group=group), results
    if col_local is not None:
        return row, WgradInput("quantized", col_local, group=group), results
    return (row, WgradInput("high_precision", IdentityStorage(data=x2d.detach(), transposed=False),
                            group=group, quantizer=quantizer, state=state), results)
