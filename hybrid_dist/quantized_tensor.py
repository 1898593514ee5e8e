"""``QuantizedTensor``: a ``torch.Tensor`` wrapper subclass holding up to two directions.

The wrapper has the logical shape and high-precision dtype of the tensor it quantizes;
its data lives in per-direction storages (``t.rowwise``, ``t.columnwise``; see
``formats/_storage`` for the stored layouts). ``__torch_dispatch__`` is a lookup in
``OPS``, which ``_tensor_ops`` fills through ``implements``; an op not in the table raises
``NotImplementedError`` naming it.

FSDP2 finds ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` on the class; their
implementations live in ``hybrid_dist.fsdp2``, which hands them over with
``register_fsdp_hooks`` when imported (``hybrid_dist/__init__`` imports it last).

Inner tensors are flattened as ``"<direction>__<field>"`` (e.g. ``rowwise__data``), which
is also how they are reachable as attributes, so ``torch.compile`` and FSDP2 can see them.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

import torch

from hybrid_dist.formats._storage import DirectionStorage, storage_meta_fields
from hybrid_dist.presigned import presigned

DIRECTIONS = ("rowwise", "columnwise")
OPS: dict = {}  # aten op (or overload packet) -> impl(func, args, kwargs); filled by _tensor_ops
_FSDP_HOOKS: dict[str, Callable] = {}  # "pre" / "post" -> implementation (register_fsdp_hooks)


def implements(ops):
    """Decorator: ``fn(func, args, kwargs)`` handles each of ``ops`` on a QuantizedTensor."""
    def register(fn):
        for op in ops:
            OPS[op] = fn
        return fn

    return register


def register_fsdp_hooks(pre_all_gather: Callable, post_all_gather: Callable) -> None:
    """Install the implementations behind ``QuantizedTensor.fsdp_pre_all_gather`` (called as
    ``pre_all_gather(tensor, mesh, outer_size, outer_stride, module, mp_policy)``) and
    ``fsdp_post_all_gather`` (``post_all_gather(tensor, outputs, metadata, param_dtype, out=)``)."""
    _FSDP_HOOKS.update(pre=pre_all_gather, post=post_all_gather)


def _fsdp_hook(which: str) -> Callable:
    hook = _FSDP_HOOKS.get(which)
    if hook is None:
        raise RuntimeError(
            "QuantizedTensor's FSDP2 hooks are not registered: hybrid_dist.fsdp2 registers them "
            "when imported (import hybrid_dist does, where torch.distributed is available)")
    return hook


class QuantizedTensor(torch.Tensor):
    """A tensor quantized per direction; build with ``quantizer.quantize(x)``."""

    _rowwise: DirectionStorage | None  # fprop operand, stored [M, K]
    _columnwise: DirectionStorage | None  # backward operand, stored [K, M]
    _quantizer: Any  # the Quantizer that made it; re-quantizes on copy_ from high precision

    @staticmethod
    def __new__(cls, shape, dtype, rowwise, columnwise, quantizer, *, requires_grad=False):
        if rowwise is None and columnwise is None:
            raise ValueError("QuantizedTensor needs at least one of rowwise / columnwise")
        device = (rowwise or columnwise).device
        self = torch.Tensor._make_wrapper_subclass(
            cls, tuple(shape), dtype=dtype, device=device, requires_grad=requires_grad
        )
        self._rowwise = rowwise
        self._columnwise = columnwise
        self._quantizer = quantizer
        _expose_inner_tensors(self)
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    # --- public -------------------------------------------------------------------
    @property
    def rowwise(self) -> DirectionStorage | None:
        return self._rowwise

    @property
    def columnwise(self) -> DirectionStorage | None:
        return self._columnwise

    @property
    def quantizer(self):
        return self._quantizer

    def storage_of(self, direction: str) -> DirectionStorage | None:
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be 'rowwise' or 'columnwise', got {direction!r}")
        return self._rowwise if direction == "rowwise" else self._columnwise

    def dequantize(self, direction: str | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Plain tensor of this shape from ``direction``; by default from the more precise
        direction present."""
        if direction is None:
            present = [d for d in DIRECTIONS if self.storage_of(d) is not None]
            direction = max(present, key=lambda d: self._quantizer.direction_quantizer(d).PRECISION_RANK)
        st = self.storage_of(direction)
        if st is None:
            raise ValueError(
                f"this QuantizedTensor has no {direction} direction (it has "
                f"{[d for d in DIRECTIONS if self.storage_of(d) is not None]}); quantize "
                f"with {direction}=True"
            )
        return st.dequantize(dtype or self.dtype).reshape(self.shape)

    def follow_dtype(self) -> None:
        """Give high-precision (identity) directions whose quantizer keeps the input's dtype
        this tensor's dtype, in place: after ``module.to(dtype)``, which changes a
        parameter's dtype but not its storages. A columnwise view of the rowwise data stays
        a view. Quantized directions are untouched."""
        row, col = self._rowwise, self._columnwise

        def identity(st) -> bool:
            return st is not None and st.FORMAT == "identity"

        def stale(st, d) -> bool:
            return (identity(st) and st.data.dtype != self.dtype and st.data.is_floating_point()
                    and self._quantizer.direction_quantizer(d).dtype is None)

        shared = identity(row) and identity(col) and col.data.data_ptr() == row.data.data_ptr()
        if stale(row, "rowwise"):
            self._rowwise = row.with_tensors({"data": row.data.to(self.dtype)})
        if stale(col, "columnwise"):
            data = self._rowwise.data.t() if shared else col.data.to(self.dtype)
            self._columnwise = col.with_tensors({"data": data})
        _expose_inner_tensors(self)

    def nbytes_by_direction(self) -> dict[str, int]:
        return {d: self.storage_of(d).nbytes() for d in DIRECTIONS if self.storage_of(d) is not None}

    def __repr__(self, *, tensor_contents=None) -> str:
        dirs = {d: type(self.storage_of(d)).__name__ for d in DIRECTIONS if self.storage_of(d) is not None}
        return (
            f"QuantizedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"device={self.device}, directions={dirs}, quantizer={self._quantizer})"
        )

    # --- FSDP2 all-gather extension (implemented in hybrid_dist.fsdp2) ----------------
    @presigned  # FSDP2 inspects its signature at every unshard
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """FSDP2 hook: this shard's buffers of the direction(s) the pass needs."""
        return _fsdp_hook("pre")(self, mesh, outer_size, outer_stride, module, mp_policy)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """FSDP2 hook: build (or refresh ``out``) the unsharded QuantizedTensor."""
        return _fsdp_hook("post")(self, all_gather_outputs, metadata, param_dtype, out=out)

    # --- flatten / unflatten ------------------------------------------------------
    def __tensor_flatten__(self):
        """Inner tensor names and ``(meta, quantizer, dtype, key)``; built once per set of
        storage objects (frozen dataclasses) and kept on the tensor: Dynamo's guards call
        this on every compiled call, for every quantized parameter."""
        flat = self.__dict__.get("_hd_flat")
        if (flat is None or flat[0] is not self._rowwise or flat[1] is not self._columnwise
                or flat[2] is not self._quantizer):
            names, meta = [], {}
            for d in DIRECTIONS:
                st = self.storage_of(d)
                if st is not None:
                    names += [f"{d}__{f}" for f in st.TENSOR_FIELDS]
                    meta[d] = _storage_meta(st)
            key = (tuple((d, cls, tuple(fields.items())) for d, (cls, fields) in meta.items()),
                   encode_config(self._quantizer), self.dtype)
            flat = (self._rowwise, self._columnwise, self._quantizer, names, (meta, self._quantizer, self.dtype, key))
            self.__dict__["_hd_flat"] = flat
        return list(flat[3]), flat[4]

    @classmethod
    def __metadata_guard__(cls, orig, other) -> bool:
        """Dynamo's guard on the flatten context: the ``key`` of plain values (format
        classes, storage metadata, the quantizer's configuration, dtype) compares in C."""
        return orig[3] == other[3]

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        meta, quantizer, dtype, _ = ctx
        storages = {}
        for d, (cls, fields) in meta.items():
            tensors = {f: inner_tensors[f"{d}__{f}"] for f in cls.TENSOR_FIELDS}
            storages[d] = cls(**fields, **tensors)
        return QuantizedTensor(
            outer_size, dtype, storages.get("rowwise"), storages.get("columnwise"), quantizer
        )

    # --- pickling (torch.save; torch.load(weights_only=True) after add_safe_globals) --
    def __reduce_ex__(self, protocol):
        storages = tuple(
            None if st is None else (type(st), storage_meta_fields(st), st.tensors())
            for st in (self._rowwise, self._columnwise)
        )
        args = (tuple(self.shape), self.dtype, self.requires_grad, storages, encode_config(self._quantizer))
        return (_rebuild_quantized_tensor, args)

    # --- dispatch -----------------------------------------------------------------
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        impl = OPS.get(func) or OPS.get(func.overloadpacket)
        if impl is None:
            raise NotImplementedError(
                f"{func} is not supported on hd.QuantizedTensor. Supported ops: detach, "
                "clone, _to_copy, copy_, view/reshape of leading dims, split/slice/narrow "
                "along dim 0, new_zeros, empty_like, zero_. Call .dequantize() first for "
                "anything else."
            )
        return impl(func, args, kwargs or {})


# FSDP2 calls ``inspect.signature`` on the pre-all-gather hook at every all-gather of every
# parameter; a precomputed ``__signature__`` turns that ~10 µs parse into a lookup.
QuantizedTensor.fsdp_pre_all_gather.__signature__ = inspect.signature(QuantizedTensor.fsdp_pre_all_gather)


def _expose_inner_tensors(t: QuantizedTensor) -> None:
    """Set ``t.<direction>__<field>`` to each inner tensor: plain attributes (no
    ``__getattr__``), so Dynamo reads them from a parameter's source like any attribute."""
    for d in DIRECTIONS:
        st = getattr(t, f"_{d}")
        if st is not None:
            for f in st.TENSOR_FIELDS:
                t.__dict__[f"{d}__{f}"] = getattr(st, f)


def _storage_meta(st: DirectionStorage):
    return (type(st), storage_meta_fields(st))


def encode_config(q) -> Any:
    """A quantizer (frozen dataclass, possibly nested) as ``(cls, ((field, value), ...))``
    so that it unpickles with ``weights_only=True`` (only the class is a global)."""
    if dataclasses.is_dataclass(q) and not isinstance(q, type):
        return (type(q), tuple((f.name, encode_config(getattr(q, f.name))) for f in dataclasses.fields(q)))
    return q


def decode_config(obj) -> Any:
    if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[0], type) and dataclasses.is_dataclass(obj[0]):
        cls, fields = obj
        return cls(**{k: decode_config(v) for k, v in fields})
    return obj


def _rebuild_quantized_tensor(shape, dtype, requires_grad, storages, quantizer):
    built = [None if s is None else s[0](**s[1], **s[2]) for s in storages]
    return QuantizedTensor(
        shape, dtype, built[0], built[1], decode_config(quantizer), requires_grad=requires_grad
    )
