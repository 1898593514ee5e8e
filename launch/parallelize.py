"""Apply tensor/expert parallelism, activation checkpointing, ``torch.compile`` and FSDP2
to a :class:`~hybrid_dist.launch.model.Transformer`, in that order (as torchtitan does).

TP and EP come from ``hybrid_dist.tensor_parallel`` and ``hybrid_dist.moe``; while those
packages do not expose what is needed, asking for ``--tp``/``--ep`` > 1 raises
``NotImplementedError`` naming the missing piece.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from hybrid_dist.launch.config import TrainConfig
from hybrid_dist.launch.mesh import Meshes, ParallelDims

# What each integration must export for the launcher to wire it in.
TP_API = ("ColwiseParallel", "RowwiseParallel")
EP_API = ("apply_expert_parallel",)


def missing_api(module_name: str, names: tuple[str, ...]) -> list[str]:
    """The names in ``names`` that ``hybrid_dist.<module_name>`` does not export yet."""
    import importlib

    mod = importlib.import_module(f"hybrid_dist.{module_name}")
    return [n for n in names if not hasattr(mod, n)]


def apply_tp(model: nn.Module, tp_mesh) -> None:
    """Megatron layout: wq/wk/wv/w1/w3 column-parallel, wo/w2 row-parallel."""
    missing = missing_api("tensor_parallel", TP_API)
    if missing:
        raise NotImplementedError(
            f"--tp {tp_mesh.size()} needs hybrid_dist.tensor_parallel.{{{', '.join(missing)}}}, which "
            "that package does not export yet (the tensor-parallel issue); run with --tp 1")
    from torch.distributed.tensor.parallel import parallelize_module

    from hybrid_dist import tensor_parallel as htp

    plan = {f"attention.{n}": htp.ColwiseParallel() for n in ("wq", "wk", "wv")}
    plan["attention.wo"] = htp.RowwiseParallel()
    if isinstance(getattr(model.layers["0"], "feed_forward", None), nn.Module) and not model.cfg.moe_experts:
        plan.update({"feed_forward.w1": htp.ColwiseParallel(), "feed_forward.w3": htp.ColwiseParallel(),
                     "feed_forward.w2": htp.RowwiseParallel()})
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, plan)


def apply_ep(model: nn.Module, ep_mesh) -> None:
    missing = missing_api("moe", EP_API)
    if missing:
        raise NotImplementedError(
            f"--ep {ep_mesh.size()} needs hybrid_dist.moe.{{{', '.join(missing)}}}, which that package "
            "does not export yet (the MoE issue); run with --ep 1")
    from hybrid_dist import moe

    for block in model.layers.values():
        moe.apply_expert_parallel(block.feed_forward, ep_mesh)


def apply_ac(model: nn.Module) -> None:
    """Full activation checkpointing of every block (non-reentrant)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for name, block in list(model.layers.items()):
        model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)


def apply_fsdp(model: nn.Module, fsdp_mesh, *, param_dtype: torch.dtype, cpu_offload: bool) -> None:
    """``fully_shard`` each block, then the root (embedding, norm, head). Applied even on
    one rank, where it only casts parameters to ``param_dtype`` for compute."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    kw = dict(mesh=fsdp_mesh, mp_policy=mp)
    if cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        fully_shard(block, reshard_after_forward=i < len(blocks) - 1, **kw)
    fully_shard(model, **kw)


def needs_fsdp(cfg: TrainConfig, dims: ParallelDims, param_dtype: torch.dtype) -> bool:
    """FSDP2 shards over dp ranks, casts for mixed precision and offloads to CPU; on one
    fp32 rank without offload it has nothing to do."""
    return dims.dp > 1 or param_dtype != torch.float32 or cfg.cpu_offload


def parallelize(model: nn.Module, cfg: TrainConfig, dims: ParallelDims, meshes: Meshes, *,
                param_dtype: torch.dtype, device_type: str) -> nn.Module:
    if dims.tp > 1:
        apply_tp(model, meshes.tp)
    if dims.ep > 1:
        apply_ep(model, meshes.ep)
    if cfg.activation_checkpointing:
        apply_ac(model)
    if cfg.compile:
        for name, block in list(model.layers.items()):
            model.layers[name] = torch.compile(block)
    if cfg.cpu_offload and device_type != "cuda":
        raise ValueError("--cpu-offload moves sharded parameters to CPU between uses; it needs a CUDA device")
    if needs_fsdp(cfg, dims, param_dtype):
        apply_fsdp(model, meshes.fsdp, param_dtype=param_dtype, cpu_offload=cfg.cpu_offload)
    return model
