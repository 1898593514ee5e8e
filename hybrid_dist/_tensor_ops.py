"""The op table of :class:`QuantizedTensor` (``__torch_dispatch__`` is a lookup here).

Each entry works per direction through the storage's logical dim-0 operations
(``DirectionStorage.narrow_dim0`` / ``new_zeros_dim0`` / ``cat_dim0``), which is what
FSDP2 sharding (``split``, ``new_zeros``, ``narrow``, ``copy_``) and device moves need.
Views are legal only where they keep the last dim (the storages are 2D ``[M, K]``).
A kept high-precision init (``hp_init``) follows each op that makes a tensor from another.
"""

from __future__ import annotations

import torch

from hybrid_dist import _kernel_registry, hp_init
from hybrid_dist.hybrid import stateless
from hybrid_dist.quantized_tensor import DIRECTIONS, QuantizedTensor, implements

aten = torch.ops.aten


def _rewrap(t: QuantizedTensor, fn, shape=None, init_fn=None) -> QuantizedTensor:
    """New wrapper with ``fn`` applied to each present storage and ``init_fn`` (default:
    the same tensor, an alias) to a kept high-precision init."""
    row = None if t.rowwise is None else fn(t.rowwise)
    col = None if t.columnwise is None else fn(t.columnwise)
    new = QuantizedTensor(t.shape if shape is None else shape, t.dtype, row, col, t.quantizer)
    return hp_init.follow(new, t, init_fn or (lambda hp: hp))


@implements([aten.detach.default, aten.alias.default])
def _detach(func, args, kwargs):
    return _rewrap(args[0], lambda st: st)


@implements([aten.clone.default])
def _clone(func, args, kwargs):
    return _rewrap(args[0], lambda st: st.map_tensors(lambda x: x.clone()), init_fn=torch.clone)


@implements([aten._to_copy.default])
def _to_copy(func, args, kwargs):
    t = args[0]
    device = kwargs.get("device") or t.device
    dtype = kwargs.get("dtype") or t.dtype
    pin = kwargs.get("pin_memory") or False
    moved = _rewrap(t, lambda st: st.map_tensors(lambda x: _move(x, device, pin)),
                    init_fn=lambda hp: _move(hp, device, pin))
    if dtype != t.dtype:
        return moved.dequantize(dtype=dtype)  # a dtype cast leaves the quantized domain
    return moved


def _move(x: torch.Tensor, device, pin: bool) -> torch.Tensor:
    y = x.to(device=device, copy=True)
    return y.pin_memory() if pin and y.device.type == "cpu" else y


@implements([aten.is_pinned.default])
def _is_pinned(func, args, kwargs):
    t = args[0]
    return all(x.is_pinned() for d in DIRECTIONS if t.storage_of(d) for x in t.storage_of(d).tensors().values())


@implements([aten._pin_memory.default])
def _pin(func, args, kwargs):
    return _rewrap(args[0], lambda st: st.map_tensors(lambda x: x.pin_memory()), init_fn=lambda hp: hp.pin_memory())


@implements([aten.view.default, aten._unsafe_view.default, aten.reshape.default])
def _view(func, args, kwargs):
    t, size = args[0], list(args[1])
    if -1 in size:
        known = 1
        for s in size:
            known *= s if s != -1 else 1
        size[size.index(-1)] = t.numel() // known if known else 0
    if len(size) == 1 and size[0] == t.numel() and t.dim() >= 2:
        # Flat alias (FSDP2 keeps one as ``_sharded_param_data``): same storages, 1D shape.
        return _rewrap(t, lambda st: st, shape=torch.Size(size), init_fn=lambda hp: hp.view(size))
    if len(size) < 2 or size[-1] != t.shape[-1] or torch.Size(size).numel() != t.numel():
        raise NotImplementedError(
            f"{func}: a QuantizedTensor of shape {tuple(t.shape)} can only be viewed as a "
            f"shape with the same last dim and >= 2 dims (its storage is [M, K]); got "
            f"{tuple(args[1])}. Dequantize first to reshape freely."
        )
    return _rewrap(t, lambda st: st, shape=torch.Size(size), init_fn=lambda hp: hp.view(size))


@implements([aten.as_strided.default])
def _as_strided(func, args, kwargs):
    t, size, stride = args[0], args[1], args[2]
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset", 0)
    if tuple(size) == tuple(t.shape) and tuple(stride) == tuple(t.stride()) and not offset:
        return _rewrap(t, lambda st: st)
    raise NotImplementedError(
        f"aten.as_strided on a QuantizedTensor is only supported as a no-op (same size and "
        f"stride); got size={tuple(size)} stride={tuple(stride)} offset={offset}"
    )


def _narrow0(t: QuantizedTensor, start: int, length: int) -> QuantizedTensor:
    shape = torch.Size([length, *t.shape[1:]])
    inner = t.shape[1:].numel() // t.shape[-1]  # rows of the 2D view per dim-0 index
    return _rewrap(t, lambda st: st.narrow_dim0(start * inner, length * inner), shape=shape,
                   init_fn=lambda hp: hp.narrow(0, start, length))


@implements([aten.slice.Tensor])
def _slice(func, args, kwargs):
    t = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    start = args[2] if len(args) > 2 else kwargs.get("start")
    end = args[3] if len(args) > 3 else kwargs.get("end")
    step = args[4] if len(args) > 4 else kwargs.get("step", 1)
    dim = dim % t.dim()
    size = t.shape[dim]
    start = 0 if start is None else max(0, min(size, start + size if start < 0 else start))
    end = size if end is None else max(start, min(size, end + size if end < 0 else end))
    if start == 0 and end == size and step == 1:
        return _rewrap(t, lambda st: st)
    if dim != 0 or step != 1:
        raise NotImplementedError(
            f"aten.slice on a QuantizedTensor supports dim 0 with step 1 only; got dim={dim}, "
            f"step={step}. Dequantize first for other slices."
        )
    return _narrow0(t, start, end - start)


@implements([aten.split.Tensor, aten.split_with_sizes.default])
def _split(func, args, kwargs):
    t, sizes = args[0], args[1]
    dim = (args[2] if len(args) > 2 else kwargs.get("dim", 0)) % t.dim()
    if dim != 0:
        raise NotImplementedError(f"{func} on a QuantizedTensor supports dim 0 only; got dim={dim}")
    n = t.shape[0]
    if isinstance(sizes, int):
        sizes = [min(sizes, n - s) for s in range(0, n, sizes)] if n else [0]
    if sum(sizes) != n:
        raise ValueError(f"{func}: split sizes {list(sizes)} must sum to dim 0's size {n}")
    out, start = [], 0
    for s in sizes:
        out.append(_narrow0(t, start, s))
        start += s
    return out


@implements([aten.cat.default])
def _cat(func, args, kwargs):
    tensors = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    first = tensors[0]
    if dim % first.dim() != 0 or not all(isinstance(x, QuantizedTensor) for x in tensors):
        raise NotImplementedError("aten.cat of QuantizedTensors supports dim 0 of quantized inputs only")
    storages = {}
    for d in DIRECTIONS:
        parts = [x.storage_of(d) for x in tensors]
        if any(p is None for p in parts) != all(p is None for p in parts):
            raise ValueError(f"aten.cat: every input needs the {d} direction, or none")
        if parts[0] is not None:
            storages[d] = type(parts[0]).cat_dim0(parts)
    shape = torch.Size([sum(x.shape[0] for x in tensors), *first.shape[1:]])
    out = QuantizedTensor(shape, first.dtype, storages.get("rowwise"), storages.get("columnwise"), first.quantizer)
    inits = [hp_init.kept(x) for x in tensors]
    if all(hp is not None for hp in inits):
        hp_init.keep(out, torch.cat(inits), copy=False)
    return out


@implements([aten.new_zeros.default, aten.new_empty.default])
def _new_zeros(func, args, kwargs):
    t, size = args[0], torch.Size(args[1])
    if len(size) < 2 or size[1:] != t.shape[1:]:
        raise NotImplementedError(
            f"{func} on a QuantizedTensor of shape {tuple(t.shape)} supports sizes that differ "
            f"in dim 0 only; got {tuple(size)}"
        )
    rows = size.numel() // t.shape[-1]
    # a buffer to copy_ into (FSDP2's padded shard): the init gets one too (hp_init note)
    return _rewrap(t, lambda st: st.new_zeros_dim0(rows), shape=size, init_fn=lambda hp: hp.new_zeros(size))


@implements([aten.empty_like.default, aten.zeros_like.default])
def _empty_like(func, args, kwargs):
    t = args[0]
    return _rewrap(t, lambda st: st.new_zeros_dim0(t.numel() // t.shape[-1]), init_fn=lambda hp: None)


@implements([aten.zero_.default])
def _zero_(func, args, kwargs):
    t = args[0]
    for d in DIRECTIONS:
        if t.storage_of(d) is not None:
            for x in t.storage_of(d).tensors().values():
                x.zero_()
    if hp_init.kept(t) is not None:
        hp_init.kept(t).zero_()
    return t


@implements([aten.copy_.default])
def _copy_(func, args, kwargs):
    dst, src = args[0], args[1]
    if not isinstance(dst, QuantizedTensor):  # quantized -> high precision
        return dst.copy_(src.dequantize(dtype=dst.dtype))
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"copy_: shape mismatch, dst {tuple(dst.shape)} vs src {tuple(src.shape)}")
    if isinstance(src, QuantizedTensor) and _compatible(dst, src):
        for d in DIRECTIONS:
            if dst.storage_of(d) is not None:
                dst.storage_of(d).copy_from(src.storage_of(d).map_tensors(lambda x: x.to(dst.device)))
        if hp_init.kept(dst) is not None:
            src_init = hp_init.kept(src)
            hp_init.write(dst, src_init if src_init is not None else src.dequantize(dtype=torch.float32))
        return dst
    hp = src.dequantize() if isinstance(src, QuantizedTensor) else src
    requantize_(dst, hp)
    return dst


def _compatible(dst: QuantizedTensor, src: QuantizedTensor) -> bool:
    for d in DIRECTIONS:
        a, b = dst.storage_of(d), src.storage_of(d)
        if a is not None and (b is None or not a.same_meta(b) or a.shape2d != b.shape2d):
            return False
    return True


def requantize_(dst: QuantizedTensor, hp: torch.Tensor, *, state=None, amax=None) -> None:
    """Quantize ``hp`` with ``dst``'s quantizer into ``dst``'s buffers, in place."""
    directions = {d: dst.storage_of(d) is not None for d in DIRECTIONS}
    q = stateless(dst.quantizer) if state is None else dst.quantizer
    hp = hp.to(dst.device)
    hp_init.write(dst, hp)  # a kept init is what the data quantizes (hp_init note)
    if state is None and not torch.compiler.is_compiling():  # eager: straight into dst's buffers
        into = _kernel_registry.quantize_into_impl_for(q, hp)
        if into is not None and hp.dim() >= 2:
            hp2d = hp.detach().reshape(-1, hp.shape[-1])
            if into(q, hp2d, dst.storage_of("rowwise"), dst.storage_of("columnwise"), amax) is not NotImplemented:
                return
    new = q.quantize(hp, state=state, amax=amax, **directions)
    for d in DIRECTIONS:
        if directions[d]:
            dst.storage_of(d).copy_from(new.storage_of(d))

