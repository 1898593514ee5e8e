"""Per-direction storage: one direction of a quantized 2D tensor, GEMM-ready.

[Note: stored form]
A logical tensor ``[*, K]`` is viewed as 2D ``[M, K]`` (``M = prod(leading dims)``). Each
direction is stored as a 2D matrix ``[R, C]`` whose **last dim is the dim its GEMMs
contract**, with quantization blocks running along C:

* rowwise    : ``[R, C] = [M, K]`` (``transposed=False``), blocks along K;
* columnwise : ``[R, C] = [K, M]`` (``transposed=True``),  blocks along M.

So columnwise quantization of ``x`` is rowwise quantization of ``x.T`` for every 1D-block
format, and every GEMM of a Linear is ``out = A_stored @ B_stored.T`` ("NT") — exactly
the layout ``torch._scaled_mm`` wants (A row-major, B column-major).

Each storage class lists its tensor fields and, per field, which axis follows stored rows
(``"R"``) and stored columns (``"C"``) and how many logical elements one index covers
(``field_axes``). Slicing, splitting, concatenating and zero-allocating along the logical
dim 0 (what FSDP2 sharding and all-gathers need) are derived from that table once, here.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from hybrid_dist import _kernel_registry

# field -> {"R" or "C": (axis in the field tensor, logical elements per index)}
FieldAxes = dict[str, dict[str, tuple[int, int]]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DirectionStorage:
    """Base class of the per-direction storages (see the note above).

    Subclasses are frozen dataclasses whose ``TENSOR_FIELDS`` name their tensor fields;
    every other field is metadata. Values change only in place (``copy_``), never by
    rebinding, so views handed out (FSDP2 shards, saved tensors) stay valid.
    """

    TENSOR_FIELDS: ClassVar[tuple[str, ...]] = ()
    transposed: bool  # False: rowwise [M, K]; True: columnwise stored as [K, M]
    FORMAT: ClassVar[str] = ""

    # --- to implement -------------------------------------------------------------
    @property
    def shape2d(self) -> tuple[int, int]:
        """Stored ``(R, C)``: the ``data`` field's shape (formats that pack elements override)."""
        return tuple(self.data.shape)

    def field_axes(self) -> FieldAxes:
        raise NotImplementedError

    def values(self, *, undo_rht: bool = True) -> torch.Tensor:
        """fp32 ``[R, C]`` with block scales applied, per-tensor scale **not** applied.
        ``undo_rht=False`` keeps a Hadamard-transformed direction in its transformed domain."""
        raise NotImplementedError

    def tensor_scale(self) -> torch.Tensor | None:
        """fp32 scalar to apply to the GEMM accumulator, or None."""
        return None

    # --- derived ------------------------------------------------------------------
    @property
    def logical_shape2d(self) -> tuple[int, int]:
        r, c = self.shape2d
        return (c, r) if self.transposed else (r, c)

    @property
    def device(self) -> torch.device:
        return getattr(self, self.TENSOR_FIELDS[0]).device

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f: getattr(self, f) for f in self.TENSOR_FIELDS}

    def with_tensors(self, tensors: dict[str, torch.Tensor]) -> "DirectionStorage":
        return dataclasses.replace(self, **tensors)

    def map_tensors(self, fn) -> "DirectionStorage":
        return self.with_tensors({f: fn(t) for f, t in self.tensors().items()})

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Logical ``[M, K]`` in ``dtype``. bf16 of a format with a registered kernel
        (``_kernel_registry.register_dequantize_bf16``) is one pass of that kernel, bitwise
        the reference below."""
        impl = _kernel_registry.dequantize_bf16_impl_for(self, self.device) if dtype == torch.bfloat16 else None
        if impl is not None:
            v = impl(self)
            return v.t() if self.transposed else v
        v = self.values()
        s = self.tensor_scale()
        if s is not None:
            v = v * s
        return (v.t() if self.transposed else v).to(dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    # --- logical dim-0 operations ---------------------------------------------------
    def _dim0_key(self) -> str:
        return "C" if self.transposed else "R"

    def dim0_granularity(self) -> int:
        """Logical dim-0 offsets/lengths must be multiples of this to slice exactly."""
        key = self._dim0_key()
        return max([1] + [ax[key][1] for ax in self.field_axes().values() if key in ax])

    def narrow_dim0(self, start: int, length: int) -> "DirectionStorage":
        key, g = self._dim0_key(), self.dim0_granularity()
        if start % g or length % g:
            raise NotImplementedError(
                f"{self.FORMAT} {'columnwise' if self.transposed else 'rowwise'} storage can "
                f"only be sliced along dim 0 at multiples of {g} rows (block size); got "
                f"start={start}, length={length}. Use a shard size that is a multiple of {g}."
            )
        out = {}
        for f, t in self.tensors().items():
            ax = self.field_axes()[f].get(key)
            out[f] = t if ax is None else t.narrow(ax[0], start // ax[1], length // ax[1])
        return self.with_tensors(out)

    def new_zeros_dim0(self, rows: int) -> "DirectionStorage":
        key = self._dim0_key()
        out = {}
        for f, t in self.tensors().items():
            ax = self.field_axes()[f].get(key)
            shape = list(t.shape)
            if ax is not None:
                shape[ax[0]] = rows // ax[1]
            out[f] = t.new_zeros(shape)
        return self.with_tensors(out)

    @classmethod
    def cat_dim0(cls, parts: list["DirectionStorage"]) -> "DirectionStorage":
        first = parts[0]
        key = first._dim0_key()
        out = {}
        for f in first.TENSOR_FIELDS:
            ax = first.field_axes()[f].get(key)
            ts = [getattr(p, f) for p in parts]
            if ax is None:
                if not all(torch.equal(ts[0], t) for t in ts[1:]):
                    raise ValueError(
                        f"cannot concatenate {first.FORMAT} storages along dim 0: their "
                        f"per-tensor field '{f}' differs. Reduce the amax over the group first."
                    )
                out[f] = ts[0]
            else:
                out[f] = torch.cat(ts, dim=ax[0])
        return first.with_tensors(out)

    def copy_from(self, src: "DirectionStorage") -> None:
        if type(src) is not type(self) or src.transposed != self.transposed:
            raise ValueError(
                f"cannot copy a {type(src).__name__} (transposed={src.transposed}) into a "
                f"{type(self).__name__} (transposed={self.transposed})"
            )
        for f, t in self.tensors().items():
            t.copy_(getattr(src, f))

    def same_meta(self, other: "DirectionStorage") -> bool:
        if type(other) is not type(self):
            return False
        meta = [f.name for f in dataclasses.fields(self) if f.name not in self.TENSOR_FIELDS]
        return all(getattr(self, m) == getattr(other, m) for m in meta)


def storage_meta_fields(st: DirectionStorage) -> dict:
    """The non-tensor fields of a storage (what rebuilds it around new tensors)."""
    return {f.name: getattr(st, f.name) for f in dataclasses.fields(st) if f.name not in st.TENSOR_FIELDS}
