"""Gradient-norm clipping for parameters on different meshes (FSDP, HSDP, TP, EP experts).

``torch.nn.utils.clip_grad_norm_`` needs every DTensor on one mesh; with expert
parallelism the experts shard over a different mesh than the dense weights, and their
values differ across EP ranks. Here each parameter's squared norm is summed locally per
(mesh, sharded mesh dims) group, all-reduced once over each sharded dim, and the experts'
total is further summed over the EP group (each EP rank holds different experts).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, *, expert_params=(), ep_group=None) -> torch.Tensor:
    """Scale gradients in place so their global L2 norm is at most ``max_norm``; return the norm."""
    expert_ids = {id(p) for p in expert_params}
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    meshes = {}
    grads = []
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        local = g.to_local() if isinstance(g, DTensor) else g
        grads.append(local)
        dims = ()
        if isinstance(g, DTensor):
            dims = tuple(i for i, pl in enumerate(g.placements) if isinstance(pl, Shard))
            meshes[id(g.device_mesh)] = g.device_mesh
        key = (id(g.device_mesh) if isinstance(g, DTensor) else None, dims, id(p) in expert_ids)
        groups[key].append(local)
    total = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else None)
    for (mesh_id, dims, is_expert), locals_ in sorted(groups.items(), key=lambda kv: _order(kv[0], meshes)):
        # one read of each gradient, few launches: per-tensor L2 norms (foreach), squared and summed
        norms = torch._foreach_norm(locals_, 2.0)
        sq = torch.stack([n.float() for n in norms]).square().sum()
        for d in dims:
            dist.all_reduce(sq, group=meshes[mesh_id].get_group(d))
        if is_expert and ep_group is not None:
            dist.all_reduce(sq, group=ep_group)
        total = total + sq
    norm = total.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        by_dtype[g.dtype].append(g)
    for dtype, gs in by_dtype.items():
        torch._foreach_mul_(gs, coef.to(dtype))
    return norm


def _order(key: tuple, meshes: dict) -> tuple:
    """A group's place in the all-reduce sequence, the same on every rank (a mesh's id is
    an address, which differs between ranks: ordering by it deadlocks two sharded meshes'
    collectives): expert or not, then the mesh's dim names and shape, then the dims."""
    mesh_id, dims, is_expert = key
    mesh = meshes.get(mesh_id)
    names = tuple(mesh.mesh_dim_names or ()) if mesh is not None else ()
    shape = tuple(mesh.mesh.shape) if mesh is not None else ()
    return is_expert, mesh is not None, names, shape, dims
