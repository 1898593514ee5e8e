"""FSDP2 all-gather hooks of a :class:`HighPrecisionParam`, and the shard-alignment rule.

* **aligned** shards (dim 0 split evenly, each shard a multiple of every direction's block
  rows): each rank quantizes its shard (per-tensor formats with the all-reduced amax, so
  every shard shares the scale), and the pass gathers only the direction it needs, exactly
  as for quantized parameters (``_hooks``); the result is bitwise the full tensor's
  quantization.
* **unaligned** shards: the high-precision shard is gathered and the full tensor is
  quantized after the gather (both directions, every pass), bitwise equal to quantizing
  the full tensor.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from hybrid_dist.amax_sync import global_amaxes
from hybrid_dist.fsdp2._accounting import record_all_gather
from hybrid_dist.fsdp2._buffers import copy_keep_version
from hybrid_dist.fsdp2._hooks import gather_inputs, post_all_gather
from hybrid_dist.fsdp2._pass import gather_pass
from hybrid_dist.hybrid import stateless
from hybrid_dist.quantized_tensor import QuantizedTensor
from hybrid_dist.warn import warn_once

_DIRECTIONS = ("rowwise", "columnwise")


def block_rows(quantizer, shape) -> int:
    """Rows (of logical dim 0) a shard must be a multiple of for both directions."""
    inner = math.prod(shape[1:]) // shape[-1] if len(shape) > 1 else 1
    rows = max(quantizer.block_shape(d)[0] for d in _DIRECTIONS)
    return rows // math.gcd(rows, inner) if inner else rows


def shard_rows(shape, world: int) -> int:
    return -(-shape[0] // world)


def is_aligned(quantizer, shape, world: int) -> bool:
    rows = shard_rows(shape, world)
    return rows * world == shape[0] and rows % block_rows(quantizer, shape) == 0


@dataclasses.dataclass(frozen=True)
class _HPGatherMeta:
    shape: torch.Size
    padded_rows: int
    world_size: int
    quantizer: object


def hp_pre_all_gather(p, mesh, outer_size, outer_stride, module, mp_policy):
    world = mesh.size()
    shape = torch.Size(outer_size)
    q = stateless(p.quantizer)
    pass_ = gather_pass(module, p)
    rht_col = bool(getattr(q.direction_quantizer("columnwise"), "rht", False))
    if rht_col:  # its global scale is the transformed tensor's amax, which `amax=` cannot set
        warn_once(f"hybrid_dist.fsdp2: {type(q).__name__} with RHT on the columnwise direction is "
                  "gathered in high precision and quantized after the gather (exact, more bytes)")
    if is_aligned(q, tuple(shape), world) and world > 1 and not rht_col:
        amax = None
        if q.is_per_tensor:  # every shard must use the global scale
            amax = global_amaxes([p._data], [mesh.get_group()])[0]
        shard = q.quantize(p._data, rowwise=True, columnwise=True, amax=amax)
        return gather_inputs(shard, pass_, world, shape, getattr(mp_policy, "param_dtype", None), temporary=True)
    rows = shard_rows(shape, world)
    local = p._data
    if local.shape[0] != rows:  # FSDP2 wants the padded shard size from every rank
        local = torch.cat([local, local.new_zeros(rows - local.shape[0], *local.shape[1:])])
    nbytes = local.numel() * local.element_size()
    record_all_gather(pass_, input_bytes=nbytes, payload_bytes=nbytes, world_size=world)
    return (local.contiguous(),), _HPGatherMeta(shape, rows, world, q)


def hp_post_all_gather(p, outputs, meta, param_dtype, *, out=None):
    if not isinstance(meta, _HPGatherMeta):
        return post_all_gather(p, outputs, meta, param_dtype, out=out)
    full = outputs[0].reshape(-1, *meta.shape[1:])[: meta.shape[0]]
    new = meta.quantizer.quantize(full, rowwise=True, columnwise=True)
    if out is None:
        qt = QuantizedTensor(meta.shape, param_dtype or p.dtype, new.rowwise, new.columnwise, meta.quantizer)
        owned = [t for d in _DIRECTIONS for t in new.storage_of(d).tensors().values()]
        return qt, tuple(_dedup(owned))
    for d in _DIRECTIONS:
        for f, t in out.storage_of(d).tensors().items():
            copy_keep_version(t, getattr(new.storage_of(d), f))
    return None


def _dedup(ts):
    seen, out = set(), []
    for t in ts:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out
