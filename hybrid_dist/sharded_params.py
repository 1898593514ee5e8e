"""Quantized parameters sharded as DTensors (FSDP2, HSDP, a ``(dp, tp)`` mesh): their fp32
master shards, and the write-back with one global amax per parameter, one all-reduce per step.

A per-tensor format (FP8 per-tensor, NVFP4's global scale) is valid to all-gather only if
every shard was quantized with the same scale. After the optimizer step each rank holds
fp32 master *shards*; ``sync_amax_and_requantize`` takes ``amax(|master shard|)`` of every
per-tensor parameter, stacks them and runs **one** ``all_reduce(MAX)`` per *sharded* mesh dim
(one in total for FSDP and HSDP), then re-quantizes each local shard in place
with its global amax (``quantize(..., amax=global_amax)``; ``requantize_many_``: a constant
number of launches for per-tensor FP8 on CUDA). For shards aligned to the
format's blocks the result is bitwise the slice of quantizing the full master tensor.
"""

from __future__ import annotations

import torch

from hybrid_dist import hp_init
from hybrid_dist.amax_sync import global_amaxes
from hybrid_dist.quantized_tensor import QuantizedTensor
from hybrid_dist.requantize_many import requantize_many_


def is_sharded_quantized(p: torch.Tensor) -> bool:
    """True for a DTensor whose local tensor is a QuantizedTensor (an FSDP2 parameter)."""
    return isinstance(getattr(p, "_local_tensor", None), QuantizedTensor)


def master_shard(p: torch.Tensor) -> torch.Tensor:
    """fp32 DTensor master of a sharded quantized parameter: the local rows of its kept
    high-precision init (``hp_init``, taken: freed on the parameter), else the dequantized
    local shard. Either way bitwise the matching rows of the unsharded master."""
    local = hp_init.take(p._local_tensor)
    if local is None:
        local = p._local_tensor.dequantize(dtype=torch.float32).detach().clone()
    return like_dtensor(local, p)


def like_dtensor(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``local`` as a DTensor with DTensor ``p``'s mesh, placements, shape and stride."""
    from torch.distributed.tensor import DTensor  # torch.distributed: only where a DTensor exists

    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())


def _check_supported(q, name: str) -> None:
    for d in ("rowwise", "columnwise"):
        sub = q.direction_quantizer(d)
        if getattr(sub, "rht", False) and d == "columnwise" and sub.is_per_tensor:
            raise NotImplementedError(
                f"sync_amax_and_requantize: parameter {name} uses NVFP4 with RHT on its columnwise "
                "direction, whose global scale comes from the transformed tensor's amax; sharded "
                "RHT weights are not supported. Use NVFP4Quantizer(rht=False) for weights."
            )


@torch.no_grad()
def sync_amax_and_requantize(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Write fp32 master shards back into sharded quantized parameters.

    ``pairs``: ``(param, master)`` with ``param`` a DTensor of a QuantizedTensor shard and
    ``master`` an fp32 DTensor (or plain tensor) of the same local shape. Per-tensor formats
    get the amax over the whole parameter: one all-reduce (MAX) per mesh dim for all of them.
    The shards are re-quantized by ``requantize_many_`` (a constant number of launches for
    per-tensor FP8 on CUDA), each bitwise its ``requantize_``.
    """
    per_tensor = [(p, m) for p, m in pairs if p._local_tensor.quantizer.is_per_tensor]
    checked = set()  # parameters share quantizer objects: check each once
    for i, (p, _) in enumerate(per_tensor):
        q = p._local_tensor.quantizer
        if id(q) not in checked:
            _check_supported(q, f"#{i} of shape {tuple(p.shape)}")
            checked.add(id(q))
    for idx, amax in _global_amaxes(per_tensor):
        requantize_many_([per_tensor[i][0]._local_tensor for i in idx], [_local(per_tensor[i][1]) for i in idx],
                         amax=amax)
    rest = [(p, m) for p, m in pairs if not p._local_tensor.quantizer.is_per_tensor]
    requantize_many_([p._local_tensor for p, _ in rest], [_local(m) for _, m in rest])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _shard_dims(p) -> tuple[int, ...]:
    """Mesh dims over which ``p`` is sharded (replicated dims already agree). FSDP2 over
    ``dp`` of a TP ``Shard(0)`` parameter places ``_StridedShard`` on ``dp``, which is not
    ``is_shard()`` on every torch version: anything neither replicated nor partial counts."""
    return tuple(i for i, pl in enumerate(p.placements)
                 if not (pl.is_replicate() or pl.is_partial()) and p.device_mesh.size(i) > 1)


def _global_amaxes(pairs) -> list[tuple[list[int], torch.Tensor]]:
    """``(indices into pairs, their global amaxes [n])`` per (mesh, sharded mesh dims) group."""
    by_group: dict[tuple, list[int]] = {}
    dims_of: dict[tuple, tuple[int, ...]] = {}  # (mesh id, placements) -> _shard_dims
    for i, (p, _) in enumerate(pairs):
        mesh, placements = p.device_mesh, p.placements
        layout = (id(mesh), placements)
        dims = dims_of.get(layout)
        if dims is None:
            dims = dims_of[layout] = _shard_dims(p)
        by_group.setdefault((id(mesh), dims), []).append(i)
    out = []
    for (_, dims), idx in by_group.items():
        mesh = pairs[idx[0]][0].device_mesh
        # one all-reduce per sharded mesh dim, for all parameters at once
        out.append((idx, global_amaxes([_local(pairs[i][1]) for i in idx], [mesh.get_group(dim) for dim in dims])))
    return out


__all__ = ["is_sharded_quantized", "like_dtensor", "master_shard", "sync_amax_and_requantize"]
