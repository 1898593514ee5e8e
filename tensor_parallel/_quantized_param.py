"""Tensor-parallel sharding of quantized parameters (``hd.quantized_model_init`` weights).

A ``QuantizedTensor`` weight ``W [N, K]`` is split without re-quantizing: every direction's
storage is sliced where its blocks allow, so each shard is bitwise the slice of the full
quantized tensor (per-tensor scales stay the full tensor's). ``Shard(0)`` (column
parallel) slices logical dim 0 (``narrow_dim0``); ``Shard(1)`` (row parallel) slices
logical dim 1 = K: the stored columns of the rowwise storage ``[N, K]`` and the stored
rows of the columnwise storage ``[K, N]``, through ``field_axes()`` so that block scales
are sliced with their data. The shards own contiguous memory (FSDP2 may shard them again
over a data-parallel mesh dim); a kept fp32 init (``hd.hp_init``) is sliced alike.
"""

from __future__ import annotations

import torch

from hybrid_dist import hp_init
from hybrid_dist.formats import DirectionStorage
from hybrid_dist.quantized_tensor import DIRECTIONS, QuantizedTensor


def _narrow_dim1(st: DirectionStorage, start: int, length: int) -> DirectionStorage:
    key = "R" if st.transposed else "C"  # the stored axis that follows logical dim 1 (K)
    out = {}
    for f, t in st.tensors().items():
        ax = st.field_axes()[f].get(key)
        if ax is None:
            out[f] = t  # per-tensor field: shared by every shard
            continue
        axis, per = ax
        if start % per or length % per:
            raise NotImplementedError(
                f"tensor parallel: the {st.FORMAT} {'columnwise' if st.transposed else 'rowwise'} "
                f"storage can be split along dim 1 only at multiples of {per} (its block); got "
                f"start={start}, length={length}. Make in_features / tp a multiple of {per}.")
        out[f] = t.narrow(axis, start // per, length // per).contiguous()
    return st.with_tensors(out)


def shard_quantized(t: QuantizedTensor, dim: int, world: int, rank: int) -> QuantizedTensor:
    """Rank ``rank``'s ``1/world`` slice of ``t [N, K]`` along ``dim`` (0 or 1), bitwise the
    slice of the full quantized tensor."""
    if t.dim() != 2 or dim not in (0, 1):
        raise NotImplementedError(
            f"tensor parallel shards 2D quantized weights on dim 0 or 1; got shape {tuple(t.shape)}, dim={dim}")
    size = t.shape[dim]
    if size % world:
        raise ValueError(f"tensor parallel: dim {dim} of the weight ({size}) is not divisible by the TP size {world}")
    length = size // world
    block = max(t.quantizer.block_shape(d)[dim] for d in DIRECTIONS if t.storage_of(d) is not None)
    if length % block:
        raise NotImplementedError(
            f"tensor parallel: shards of a {type(t.quantizer).__name__} weight of shape {tuple(t.shape)} "
            f"over {world} ranks have {length} along dim {dim}, not a multiple of its {block}-element "
            "block; use a high-precision weight (create the model outside hd.quantized_model_init: "
            "TP then quantizes the local shard each step) or a TP size that keeps whole blocks.")
    if dim == 0:
        local = t.detach().narrow(0, rank * length, length)
        storages = {d: None if local.storage_of(d) is None else
                    local.storage_of(d).map_tensors(lambda x: x.contiguous()) for d in DIRECTIONS}
        shape = (length, t.shape[1])
    else:
        storages = {d: None if t.storage_of(d) is None else _narrow_dim1(t.storage_of(d), rank * length, length)
                    for d in DIRECTIONS}
        shape = (t.shape[0], length)
    out = QuantizedTensor(torch.Size(shape), t.dtype, storages["rowwise"], storages["columnwise"], t.quantizer)
    init = hp_init.kept(t)  # a kept fp32 init is sliced with the weight (the master starts from it)
    if init is not None:
        hp_init.keep(out, init.narrow(dim, rank * length, length))
    return out
