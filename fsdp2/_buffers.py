"""FSDP2 buffer protocol over :class:`DirectionStorage`: what one direction all-gathers.

[Note: transport layout]
FSDP2 shards a parameter on its logical dim 0 and all-gathers each all-gather input along
its own dim 0 (rank r's rows land at rows ``r·n .. (r+1)·n`` of the output). A storage
field whose logical-dim-0 axis (``field_axes()[f]["R" | "C"]``) is its tensor dim 0 can
travel as it is, and its gathered output *is* the unsharded field (zero copy). A
columnwise storage is stored transposed (``[K, M]``, logical dim 0 = its columns), so its
fields are transposed for transport (``[M_shard, ...]``) and back after the gather (one
copy into an owned buffer). Per-tensor fields (no dim-0 axis, e.g. the FP8 ``scale_inv``
or the NVFP4 ``global_scale``) are not gathered: they are equal on every shard (see
``hybrid_dist.sharded_params``) and travel in the metadata.

All functions here work through ``field_axes()``, so a new format needs no FSDP code.
"""

from __future__ import annotations

import dataclasses

import torch

from hybrid_dist.formats import DirectionStorage, storage_meta_fields
from hybrid_dist.formats.identity import IdentityStorage
from hybrid_dist.kernels import transposed_2d


@dataclasses.dataclass(frozen=True)
class DirectionGatherMeta:
    """How to rebuild one direction's unsharded storage from gathered buffers.

    ``axes[f]``: axis of field ``f`` that follows logical dim 0; ``shard_shapes[f]``: the
    field's transport shape on one shard (dim 0 = logical rows / elements-per-index);
    ``scalars``: the per-tensor fields (already equal on every shard).
    """

    cls: type
    meta: dict
    fields: tuple[str, ...]
    axes: dict[str, int]
    shard_shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    scalars: dict[str, torch.Tensor]
    device: torch.device

    def full_transport_shape(self, field: str, world_size: int) -> tuple[int, ...]:
        s = self.shard_shapes[field]
        return (s[0] * world_size, *s[1:])

    def signature(self) -> tuple[tuple[int, torch.dtype], ...]:
        """``(numel, wire dtype)`` per gathered buffer: equal signatures can share FSDP's
        all-gather buffers."""
        return tuple((_numel(self.shard_shapes[f]), wire_dtype(self.dtypes[f])) for f in self.fields)

    def nbytes(self) -> int:
        return sum(n * d.itemsize for n, d in self.signature())


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """1-byte floats (FP8) travel as uint8: same bytes, and every backend (gloo has no FP8)
    can move them."""
    return torch.uint8 if dtype.is_floating_point and dtype.itemsize == 1 else dtype


def _dim0_key(st: DirectionStorage) -> str:
    return "C" if st.transposed else "R"


def fsdp_buffer_fields(st: DirectionStorage) -> tuple[str, ...]:
    """Fields of ``st`` that shard on logical dim 0 (the ones to all-gather), in order."""
    key, axes = _dim0_key(st), st.field_axes()
    return tuple(f for f in st.TENSOR_FIELDS if key in axes[f])


def _transport(t: torch.Tensor, axis: int) -> torch.Tensor:
    if axis == 0:
        return t.contiguous()
    if t.dim() == 2:  # a 2D transpose: the tiled kernel on CUDA (torch's FP8 copy is slow)
        return transposed_2d(t)
    return t.movedim(axis, 0).contiguous()


def stored_into(dst: torch.Tensor | None, gathered: torch.Tensor, axis: int, dtype: torch.dtype) -> torch.Tensor:
    """Transport layout -> stored layout, copied into ``dst`` (a new contiguous tensor if
    ``None``); 2D CUDA fields through the tiled transpose kernel."""
    src = stored(gathered, axis, dtype)
    if axis != 0 and src.dim() == 2 and src.is_cuda and (dst is None or dst.is_contiguous()):
        from hybrid_dist.kernels.transpose import transpose_into

        dst = torch.empty(src.shape, dtype=dtype, device=src.device) if dst is None else dst
        return transpose_into(dst, gathered.view(dtype))
    if dst is None:
        return src.clone(memory_format=torch.contiguous_format)
    return dst.copy_(src)


def _cast_dtype(st: DirectionStorage, field: str, cast: torch.dtype | None) -> torch.dtype:
    dtype = getattr(st, field).dtype
    # Only high-precision passthrough data follows the mixed-precision param dtype.
    if cast is not None and isinstance(st, IdentityStorage) and dtype.is_floating_point:
        return cast
    return dtype


def fsdp_gather_meta(st: DirectionStorage, *, cast: torch.dtype | None = None,
                     live_scalars: bool = False) -> DirectionGatherMeta:
    """The metadata of ``st``'s all-gather. ``scalars`` are clones of the per-tensor fields,
    or with ``live_scalars`` the fields themselves (a cached plan reads the values the
    optimizer writes in place; the unsharded tensor gets copies in ``post_all_gather``)."""
    key, axes = _dim0_key(st), st.field_axes()
    fields = fsdp_buffer_fields(st)
    ax = {f: axes[f][key][0] for f in fields}
    shapes = {}
    for f in fields:
        shape = list(getattr(st, f).shape)
        shapes[f] = (shape.pop(ax[f]), *shape)
    scalars = {f: getattr(st, f) if live_scalars else getattr(st, f).detach().clone()
               for f in st.TENSOR_FIELDS if f not in fields}
    return DirectionGatherMeta(
        cls=type(st), meta=storage_meta_fields(st), fields=fields, axes=ax, shard_shapes=shapes,
        dtypes={f: _cast_dtype(st, f, cast) for f in fields}, scalars=scalars, device=st.device,
    )


def fsdp_extract_buffers(
    st: DirectionStorage, *, cast: torch.dtype | None = None
) -> tuple[list[torch.Tensor], DirectionGatherMeta]:
    """The local shard's buffers to all-gather (contiguous, logical dim 0 = tensor dim 0;
    columnwise fields transposed for transport) and the metadata to rebuild them."""
    meta = fsdp_gather_meta(st, cast=cast)
    return fsdp_transport_buffers(st, meta), meta


def fsdp_transport_buffers(st: DirectionStorage, meta: DirectionGatherMeta) -> list[torch.Tensor]:
    """``st``'s buffers to all-gather under an already built ``meta`` (``fsdp_gather_meta``
    of ``st``): contiguous, logical dim 0 = tensor dim 0, in the wire dtype."""
    return [
        _transport(getattr(st, f), meta.axes[f]).to(meta.dtypes[f]).view(wire_dtype(meta.dtypes[f]))
        for f in meta.fields
    ]


def stored(gathered: torch.Tensor, axis: int, dtype: torch.dtype) -> torch.Tensor:
    """Transport layout -> stored layout (a view; contiguous only when ``axis == 0``)."""
    gathered = gathered.view(dtype)
    return gathered if axis == 0 else gathered.movedim(0, axis)


def fsdp_assign_gathered(
    gathered: list[torch.Tensor] | None,
    meta: DirectionGatherMeta,
    world_size: int,
    *,
    out: DirectionStorage | None = None,
    alias: bool = True,
) -> tuple[DirectionStorage, list[torch.Tensor]]:
    """Build (``out=None``) or refresh in place (``out``) the unsharded storage.

    ``gathered[i]``: field ``meta.fields[i]`` in transport layout, full size
    ``[world_size · rows, ...]``; ``None`` allocates zeroed buffers without data (the
    direction this pass did not gather). Returns ``(storage, owned)`` where ``owned`` are
    the tensors FSDP must free and re-allocate around each reshard: every new buffer, and
    the gathered tensors themselves when ``alias=False`` (they are not FSDP's all-gather
    outputs). Fields with ``axis == 0`` use the gathered tensors as they are.
    """
    if out is None:
        tensors, owned = {}, []
        for i, f in enumerate(meta.fields):
            if gathered is None:
                shape = list(meta.full_transport_shape(f, world_size))
                shape.insert(meta.axes[f], shape.pop(0))
                t = torch.zeros(shape, dtype=meta.dtypes[f], device=meta.device)
                owned.append(t)
            elif meta.axes[f] == 0:
                t = gathered[i].view(meta.dtypes[f])
                if not alias:
                    owned.append(t)
            else:
                t = stored_into(None, gathered[i], meta.axes[f], meta.dtypes[f])
                owned.append(t)
            tensors[f] = t
        # per-tensor scalars are shared, not copied: a persistent shard's live fields (its
        # in-place updates reach the unsharded tensor with no copy per gather) or a clone
        tensors.update(meta.scalars)
        return meta.cls(**meta.meta, **tensors), owned
    if gathered is not None:
        run_refresh(*refresh_copies(gathered, meta, out))
    return out, []


def refresh_copies(gathered: list[torch.Tensor], meta: DirectionGatherMeta,
                   out: DirectionStorage) -> tuple[list[tuple], list[tuple]]:
    """What refreshing ``out`` in place from ``gathered`` (as ``fsdp_assign_gathered`` does)
    must copy: ``(fields, scalars)``, with ``(dst, gathered field, axis, dtype)`` for each
    field that does not alias its gathered tensor and ``(dst, src)`` for each per-tensor
    field that is not the metadata's own (a shard's live fields are shared: no copy)."""
    fields = [(getattr(out, f), gathered[i], meta.axes[f], meta.dtypes[f]) for i, f in enumerate(meta.fields)
              if not same_memory(getattr(out, f), stored(gathered[i], meta.axes[f], meta.dtypes[f]))]
    return fields, [(getattr(out, f), s) for f, s in meta.scalars.items() if getattr(out, f) is not s]


def run_refresh(fields: list[tuple], scalars: list[tuple]) -> None:
    """Run the copies of ``refresh_copies``; autograd does not see them (backward saved these
    buffers in forward, and FSDP refills them before backward)."""
    for dst, gathered, axis, dtype in fields:
        with torch.autograd._unsafe_preserve_version_counter(dst):
            stored_into(dst, gathered, axis, dtype)
    for dst, src in scalars:
        copy_keep_version(dst, src)


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape and a.stride() == b.stride()
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
    )


def copy_keep_version(dst: torch.Tensor, src: torch.Tensor) -> None:
    """In-place refresh that autograd does not see as a modification: backward saved
    these buffers in forward, and FSDP refills them before backward (as its own buffers)."""
    with torch.autograd._unsafe_preserve_version_counter(dst):
        dst.copy_(src)
