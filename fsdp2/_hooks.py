"""FSDP2 all-gather hooks of :class:`hd.QuantizedTensor` (``fsdp_pre_all_gather`` /
``fsdp_post_all_gather`` delegate here).

[Note: what a pass gathers]
``_pass.gather_pass`` says which directions this all-gather needs (forward: rowwise;
backward after a forward reshard: columnwise; no reshard after forward: both). FSDP2
allocates each parameter's all-gather outputs once, from the first call's input sizes and
dtypes, and reuses them on every later gather, so the inputs of every pass must have the
same count, numels and dtypes. Four modes keep that true:

* ``"slots"`` — both directions' gather signatures (``DirectionGatherMeta.signature``) are
  equal (every single-format quantizer: the columnwise transport layout has the rowwise
  numels): each pass sends only its direction's buffers through the same slots. The
  rowwise fields of the unsharded tensor alias the slots (zero copy); columnwise fields
  are transposed back into owned buffers.
* ``"both"`` — ``reshard_after_forward=False``: rowwise then columnwise buffers, once;
  and every gather of a recomputed module (``_pass`` [Note: activation recompute]). Where
  the columnwise data is the rowwise data transposed (``_col_from_row``) only the rowwise
  buffers travel and the columnwise is transposed from them after the gather.
* ``"packed"`` — a hybrid of two formats with different signatures: this pass's buffers
  are packed into one uint8 buffer of ``max(rowwise bytes, columnwise bytes)`` per rank,
  so the larger direction travels unpadded and the smaller one pays the padding.
* ``"local"`` — a one-rank mesh (FSDP 1, or the FSDP dimension of a TP or HSDP mesh
  of size 1), FSDP's own shard (not a copy made for the gather: CPU offload's, or
  ``quantize_on_all_gather``'s) whose fields need no mixed-precision cast: the shard
  is the whole tensor, so the unsharded tensor's storages share the shard's fields
  (no copy, no second copy of the weight in memory) and the all-gather input is one
  placeholder byte (FSDP2 copies the first all-gather input on one rank). A one-rank
  mesh otherwise packs every pass that sends more than one buffer; one buffer (per-tensor
  FP8: the codes) goes in slots.

The unsharded tensor always holds both directions as storage objects: backward saved the
columnwise storage in forward, FSDP frees it at the forward reshard and re-allocates it
(``inner tensors``) before backward, where ``post_all_gather(out=...)`` refills it. After
a backward gather its rowwise direction is hidden (``None``) until the next forward
gather, so nothing reads stale rowwise bytes (a recomputed module gathers both
directions in backward instead, see ``_pass``).
"""

from __future__ import annotations

import dataclasses

import torch

from hybrid_dist.fsdp2._accounting import record_all_gather
from hybrid_dist.fsdp2._buffers import (
    DirectionGatherMeta,
    copy_keep_version,
    fsdp_assign_gathered,
    fsdp_gather_meta,
    fsdp_transport_buffers,
    refresh_copies,
    run_refresh,
    same_memory,
)
from hybrid_dist.fsdp2._pass import BACKWARD, FORWARD, gather_pass, gathers_both, is_fsdp_shard
from hybrid_dist.formats.float8 import Float8Quantizer, Float8Storage
from hybrid_dist.quantized_tensor import QuantizedTensor

ROW, COL = "rowwise", "columnwise"


@dataclasses.dataclass(frozen=True)
class GatherMeta:
    """Metadata FSDP hands from ``pre_all_gather`` to ``post_all_gather``."""

    mode: str  # "slots" | "both" | "packed"
    pass_: str  # see _pass
    gathered: tuple[str, ...]  # directions whose data this all-gather carries
    dirs: dict[str, DirectionGatherMeta]  # every direction the parameter has
    world_size: int
    shape: torch.Size  # unsharded logical shape
    capacity: int  # "packed": bytes per rank
    quantizer: object  # the shard's quantizer (the unsharded tensor's)
    temporary: bool = False  # a shard made for this gather: its scalars need record_stream
    col_from_row: bool = False  # columnwise transport bytes are the rowwise data (see _col_from_row)
    source: tuple = ()  # "local": the shard's storages, which the unsharded tensor shares
    sent: tuple[str, ...] = ()  # directions whose buffers travel ("both" + col_from_row: rowwise only)


def pre_all_gather(t, mesh, outer_size, outer_stride, module, mp_policy):
    """``(all_gather_inputs, GatherMeta)`` for the local shard ``t`` (see the note)."""
    world = mesh.size()
    shape = torch.Size(outer_size) if outer_size is not None else torch.Size([t.shape[0] * world, *t.shape[1:]])
    if t.shape[0] * world != shape[0]:
        raise NotImplementedError(
            f"hybrid_dist.fsdp2: quantized parameter of shape {tuple(shape)} is sharded unevenly "
            f"over {world} ranks (local dim 0 = {t.shape[0]}); make dim 0 a multiple of the "
            "world size times the format's block, or call hybrid_dist.fsdp2."
            "quantize_on_all_gather(model, shard_world_size=...) before fully_shard (high-"
            "precision all-gather for such parameters)."
        )
    pass_ = gather_pass(module, t)
    # on one rank a copy of the shard (CPU offload's, to the device) is not shared ("local"
    # mode would keep it on the device): it gathers like any shard made for one gather
    temporary = world == 1 and not is_fsdp_shard(module, t)
    return gather_inputs(t, pass_, world, shape, getattr(mp_policy, "param_dtype", None), temporary=temporary)


def gather_inputs(t, pass_: str, world: int, shape: torch.Size, cast, *, temporary: bool = False):
    """All-gather inputs of the quantized shard ``t`` for ``pass_`` (see the note).

    The plan of a gather (directions, metadata, mode, input bytes) depends only on the
    shard's storage objects and the pass, so it is built once per pass and kept on ``t``
    (forward and backward alternate); each call makes only the transport buffers. The
    metadata holds the shard's live per-tensor scalars (updated in place by the
    optimizer), which ``post_all_gather`` copies. ``temporary``: ``t`` was made for this
    gather (quantized on FSDP's copy-in stream)."""
    key, storages = (pass_, world, shape, cast), (t.storage_of(ROW), t.storage_of(COL))
    plans = t.__dict__.setdefault("_hd_gather_plans", {})
    plan = plans.get(key)
    if plan is None or plan.storages[0] is not storages[0] or plan.storages[1] is not storages[1]:
        plan = plans[key] = _Plan(storages, *_gather_plan(t, pass_, world, shape, cast, temporary))
    meta = plan.meta
    inputs = plan.inputs
    if inputs is None and meta.mode == "local":
        inputs = plan.inputs = (torch.zeros(1, dtype=torch.uint8, device=t.device),)
        _check_stable(t, meta.mode, inputs)
        plan.input_bytes = 1
    elif inputs is None:
        bufs = [b for i, dm in plan.sources() for b in fsdp_transport_buffers(storages[i], dm)]
        inputs = (_pack(bufs, meta.capacity),) if meta.mode == "packed" else tuple(bufs)
        if plan.input_bytes is None:  # the plan's first gather: its signature must match every other pass's
            _check_stable(t, meta.mode, inputs)
            plan.input_bytes = sum(b.numel() * b.element_size() for b in inputs)
            if meta.mode != "packed" and all(_aliases_field(b, storages, plan) for b in inputs):
                plan.inputs = inputs  # views of the shard's own fields: valid for every later gather
    record_all_gather(pass_, input_bytes=plan.input_bytes, payload_bytes=plan.payload, world_size=world)
    return inputs, meta


def _aliases_field(buf: torch.Tensor, storages, plan: "_Plan") -> bool:
    """True when the transport buffer ``buf`` is a view of one of the shard's fields (no
    copy was made): the shard is updated in place, so the same view serves every gather."""
    ptr = buf.untyped_storage().data_ptr()
    return any(getattr(storages[i], f).untyped_storage().data_ptr() == ptr
               for i, dm in plan.sources() for f in dm.fields)


@dataclasses.dataclass
class _Plan:
    """A cached gather plan of one shard and pass (``gather_inputs``)."""

    storages: tuple  # the shard's (rowwise, columnwise) storage objects it was built for
    meta: GatherMeta
    payload: int  # bytes of data this pass carries (before padding)
    input_bytes: int | None = None  # all-gather input bytes, set by the first gather
    inputs: tuple | None = None  # the all-gather inputs when they are views of the shard's fields

    def sources(self) -> list[tuple[int, DirectionGatherMeta]]:
        """Per gathered direction, the storage (0 rowwise, 1 columnwise) whose transport
        buffers it sends and their metadata: the rowwise data for the columnwise direction
        when ``meta.col_from_row`` (no transpose)."""
        if self._sources is None:
            m = self.meta
            self._sources = [(0, m.dirs[ROW]) if d == ROW or m.col_from_row else (1, m.dirs[COL])
                             for d in m.sent]
        return self._sources

    _sources: list | None = None


def _col_from_row(t) -> bool:
    """True when the shard's columnwise data is its rowwise data transposed, byte for byte:
    one per-tensor FP8 quantizer for both directions writes both from one scale (every
    quantize, ``requantize_`` and the optimizer's write-back do), so the columnwise
    transport layout (``[rows, K]``) is the rowwise data as it is."""
    row, col, q = t.storage_of(ROW), t.storage_of(COL), t.quantizer
    rq = q.direction_quantizer(ROW)
    return (isinstance(row, Float8Storage) and isinstance(col, Float8Storage) and isinstance(rq, Float8Quantizer)
            and rq == q.direction_quantizer(COL) and not row.transposed and col.transposed
            and row.data.dtype == col.data.dtype and row.data.shape == col.data.shape[::-1])


def _gather_plan(t, pass_: str, world: int, shape: torch.Size, cast,
                 temporary: bool = False) -> tuple[GatherMeta, int]:
    """``(GatherMeta, payload bytes)`` of ``t``'s gathers in ``pass_`` (see the note)."""
    present = tuple(d for d in (ROW, COL) if t.storage_of(d) is not None)
    both = gathers_both(pass_)
    wanted = present if both else ((ROW,) if pass_ == FORWARD else (COL,))
    if any(d not in present for d in wanted):
        raise ValueError(
            f"hybrid_dist.fsdp2: the {pass_} all-gather needs the {wanted[0]} direction, but this "
            f"quantized parameter has only {present}. Create parameters with both directions "
            "(hd.quantized_model_init does)."
        )
    metas = {d: fsdp_gather_meta(t.storage_of(d), cast=cast, live_scalars=True) for d in present}
    capacity = 0
    col_from_row = COL in wanted and ROW in present and _col_from_row(t)
    sent = (ROW,) if col_from_row and ROW in wanted else wanted  # the columnwise made from the rowwise bytes
    signatures = {metas[d].signature() for d in present}
    # every pass sends the same one buffer (per-tensor FP8: the codes)
    one_buffer = ((not both and len(signatures) == 1 and len(next(iter(signatures))) == 1)
                  or (both and len(sent) == 1 and len(metas[sent[0]].fields) == 1))
    if world == 1 and not temporary and all(dm.dtypes[f] == getattr(t.storage_of(d), f).dtype
                                            for d, dm in metas.items() for f in dm.fields):
        source = tuple(t.storage_of(d) for d in (ROW, COL))
        meta = GatherMeta("local", pass_, wanted, metas, world, shape, 0, t.quantizer, source=source)
        return meta, 0
    if world == 1 and not one_buffer:  # FSDP2 copies only the first all-gather input on one rank
        capacity = sum(metas[d].nbytes() for d in sent) if both else max(m.nbytes() for m in metas.values())
        mode = "packed"
    elif both:
        mode = "both"
    elif len(signatures) == 1:
        mode = "slots"
    else:
        capacity = max(m.nbytes() for m in metas.values())
        mode = "packed"
    meta = GatherMeta(mode, pass_, wanted, metas, world, shape, capacity, t.quantizer, temporary, col_from_row,
                      sent=sent)
    return meta, sum(metas[d].nbytes() for d in sent)


def post_all_gather(t, outputs, meta: GatherMeta, param_dtype, *, out=None):
    """First call: ``(unsharded QuantizedTensor, owned inner tensors)``; later calls
    refresh ``out`` in place (FSDP re-allocated the inner tensors before calling)."""
    _claim_scalars_for_current_stream(meta)
    if meta.mode == "local":
        return _share_shard(meta, param_dtype or t.dtype, out)
    if out is None:
        views = _gathered_views(outputs, meta)
        storages, owned = {}, []
        for d, dm in meta.dirs.items():
            st, own = fsdp_assign_gathered(views.get(d), dm, meta.world_size, alias=meta.mode != "packed")
            storages[d] = st
            owned += own
        qt = QuantizedTensor(meta.shape, param_dtype or t.dtype, storages.get(ROW), storages.get(COL), meta.quantizer)
        return qt, tuple(owned)
    target = out._local_tensor if hasattr(out, "_local_tensor") else out
    _expose_rowwise(target, meta.pass_ != BACKWARD)
    program = _refresh_program(target, outputs, meta)
    run_refresh(program.fields, program.scalars)
    return None


def _share_shard(meta: GatherMeta, dtype: torch.dtype, out):
    """``"local"`` mode: the first call builds the unsharded tensor on the shard's own fields
    (FSDP owns no inner tensor of it, so it frees nothing at reshard); a later call copies
    only fields that no longer share memory with the shard's (a shard whose fields were
    replaced since, not updated in place)."""
    if out is None:
        storages = {d: st.map_tensors(lambda x: x) for d, st in zip((ROW, COL), meta.source) if st is not None}
        return QuantizedTensor(meta.shape, dtype, storages.get(ROW), storages.get(COL), meta.quantizer), ()
    target = out._local_tensor if hasattr(out, "_local_tensor") else out
    for d, src in zip((ROW, COL), meta.source):
        dst = target.storage_of(d) if src is not None else None
        for f in () if dst is None else src.TENSOR_FIELDS:
            a, b = getattr(dst, f), getattr(src, f)
            if a is not b and not same_memory(a, b):
                copy_keep_version(a, b)
    return None


@dataclasses.dataclass
class _Refresh:
    """What refreshing one unsharded tensor from one pass's all-gather outputs copies.

    FSDP2 reuses each parameter's all-gather output tensors on every gather (it frees and
    re-allocates their storage around a reshard; a view of them stays valid) and passes
    fresh views of them to ``post_all_gather``. Fields that alias the outputs need no copy;
    the others (columnwise fields in transport layout, per-tensor scalars that are not the
    shard's own) are copied (``_buffers.refresh_copies``). The program is built on the first
    refresh of a pass and reused while the outputs' base tensors, the metadata and the
    target's storages are the same."""

    bases: tuple  # the base tensors of the all-gather outputs it was built for
    meta: GatherMeta
    storages: tuple  # the target's storage objects of the gathered directions
    fields: list  # refresh_copies of every gathered direction: field copies
    scalars: list  # and scalar copies

    def matches(self, bases: tuple, meta: GatherMeta, storages: tuple) -> bool:
        return (self.meta is meta and len(bases) == len(self.bases)
                and all(a is b for a, b in zip(bases, self.bases))
                and all(a is b for a, b in zip(storages, self.storages)))


def _refresh_program(target, outputs, meta: GatherMeta) -> _Refresh:
    """The cached :class:`_Refresh` of ``target`` for these outputs (see its note); built
    when missing or stale. Multi-rank "packed" outputs are unpacked into fresh copies
    (``_unpack``), so their programs are never cached; a one-rank packed output is read in
    place, like the other modes."""
    bases = tuple(o if o._base is None else o._base for o in outputs)
    storages = tuple(target.storage_of(d) for d in meta.gathered)
    programs = target.__dict__.setdefault("_hd_refresh", {})
    program = programs.get(meta.pass_)
    if program is not None and program.matches(bases, meta, storages):
        return program
    views = _gathered_views(outputs, meta, owned=False)
    fields, scalars = [], []
    for d, st in zip(meta.gathered, storages):
        f, s = refresh_copies(views[d], meta.dirs[d], st)
        fields += f
        scalars += s
    program = _Refresh(bases, meta, storages, fields, scalars)
    if meta.mode != "packed" or meta.world_size == 1:
        programs[meta.pass_] = program
    return program


def _claim_scalars_for_current_stream(meta: GatherMeta) -> None:
    """The per-tensor scalars travel in the metadata and are read here on the compute
    stream, after which FSDP drops the metadata. A persistent shard's scalars are its own
    live fields (never freed: nothing to do), but ``quantize_on_all_gather`` quantizes a
    temporary shard on FSDP's copy-in stream: without ``record_stream`` the caching
    allocator could hand those blocks to the next parameter's gather before this stream's
    reads ran (one rank's FP8 ``scale_inv`` would come from another layer)."""
    if not meta.temporary or not torch.cuda.is_available():
        return
    for dm in meta.dirs.values():
        for s in dm.scalars.values():
            if s.is_cuda:
                s.record_stream(torch.cuda.current_stream(s.device))


def _expose_rowwise(t, valid: bool) -> None:
    """After a backward (columnwise-only) gather the rowwise buffers hold no valid data
    (they alias the shared slots or were re-allocated): hide that direction until the next
    forward gather, so a reader (e.g. an activation recompute) fails instead of computing
    with stale bytes."""
    if not valid and t._rowwise is not None:
        t._hd_hidden_rowwise = t._rowwise
        t._rowwise = None
    elif valid and t._rowwise is None and getattr(t, "_hd_hidden_rowwise", None) is not None:
        t._rowwise = t._hd_hidden_rowwise
        t._hd_hidden_rowwise = None


def _gathered_views(outputs, meta: GatherMeta, *, owned: bool = True) -> dict[str, list[torch.Tensor]]:
    """Per direction, its fields in transport layout at full size (views when possible).
    ``owned=False``: the caller only copies from them before returning, so a one-rank
    "packed" output is read in place instead of unpacked into new buffers."""
    w = meta.world_size

    def as_fields(ts, d):
        dm = meta.dirs[d]
        return [o.reshape(-1).view(dm.full_transport_shape(f, w)) for o, f in zip(ts, dm.fields)]

    if meta.mode == "packed":
        return _unpack(outputs[0], [(d, meta.dirs[d]) for d in meta.gathered], w, meta.capacity,
                       copy=owned or w > 1)
    if meta.mode == "both":
        n_row = len(meta.dirs[ROW].fields) if ROW in meta.dirs else 0
        # a derivable columnwise reads the rowwise bytes (GatherMeta.sent)
        split = {ROW: outputs[:n_row], COL: outputs[:n_row] if meta.col_from_row else outputs[n_row:]}
        return {d: as_fields(split[d], d) for d in meta.gathered}
    views = {d: as_fields(outputs, d) for d in meta.gathered}
    if ROW in meta.dirs and ROW not in views:
        views[ROW] = as_fields(outputs, ROW)  # rowwise aliases the shared slots (zero copy)
    return views


def _pack(bufs: list[torch.Tensor], capacity: int) -> torch.Tensor:
    flat = [b.reshape(-1).view(torch.uint8) for b in bufs]
    used = sum(f.numel() for f in flat)
    if used < capacity:
        flat.append(torch.zeros(capacity - used, dtype=torch.uint8, device=bufs[0].device))
    return torch.cat(flat)


def _unpack(output: torch.Tensor, dirs, world: int, capacity: int, *,
            copy: bool = True) -> dict[str, list[torch.Tensor]]:
    """Split the packed ``[world · capacity]`` bytes into each direction's full fields: new
    buffers, or (``copy=False``, one rank only: each field is then contiguous) views."""
    rows = output.reshape(-1).view(torch.uint8).view(world, capacity)
    out, off = {}, 0
    for d, dm in dirs:
        out[d] = []
        for f in dm.fields:
            shape = dm.shard_shapes[f]
            nbytes = _numel(shape) * dm.dtypes[f].itemsize
            field = rows[:, off:off + nbytes]
            field = field.clone(memory_format=torch.contiguous_format) if copy else field
            out[d].append(field.view(dm.dtypes[f]).view(world * shape[0], *shape[1:]))
            off += nbytes
    return out


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _check_stable(t, mode: str, inputs: list[torch.Tensor]) -> None:
    sig = (mode, tuple((b.numel(), b.dtype) for b in inputs))
    prev = getattr(t, "_hd_fsdp_signature", None)
    if prev is not None and prev != sig:
        raise NotImplementedError(
            f"hybrid_dist.fsdp2: this parameter's all-gather changed from {prev} to {sig} "
            "(FSDP2 reuses its all-gather buffers). Changing reshard_after_forward, or whether "
            "the module's forward is recomputed (activation checkpointing), after the first "
            "step is not supported for quantized parameters."
        )
    t._hd_fsdp_signature = sig
