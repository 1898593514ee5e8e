"""Apply tensor/expert parallelism, activation checkpointing, ``torch.compile`` and FSDP2
to a :class:`~hybrid_dist.launch.model.Transformer`, in that order (as torchtitan does).

TP uses ``hybrid_dist.tensor_parallel``'s ``ParallelStyle``s; EP is built into the model
(``hybrid_dist.moe.MoE`` with the EP process group), so here it only changes how experts
shard. If those packages lack what is needed, ``--tp``/``--ep`` > 1 raise
``NotImplementedError`` naming the missing piece.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import hybrid_dist as hd
from hybrid_dist.hoisted_advance import hoist_delayed_advance
from hybrid_dist.warn import warn_once
from hybrid_dist.launch import fsdp_copy_in, torchao_baseline
from hybrid_dist.launch.config import RESHARD_POLICIES, TrainConfig
from hybrid_dist.launch.mesh import Meshes, ParallelDims
from hybrid_dist.launch.sequence_parallel import ConsumersInput

# What each integration must export for the launcher to wire it in.
TP_API = ("HybridColwiseParallel", "HybridRowwiseParallel")
EP_API = ("MoE",)


def missing_api(module_name: str, names: tuple[str, ...]) -> list[str]:
    """The names in ``names`` that ``hybrid_dist.<module_name>`` does not export yet."""
    import importlib

    mod = importlib.import_module(f"hybrid_dist.{module_name}")
    return [n for n in names if not hasattr(mod, n)]


def require(module_name: str, names: tuple[str, ...], flag: str) -> None:
    missing = missing_api(module_name, names)
    if missing:
        raise NotImplementedError(
            f"{flag} needs hybrid_dist.{module_name}.{{{', '.join(missing)}}}, which that package does not "
            f"export yet; run without {flag.split()[0]}")


def apply_tp(model: nn.Module, tp_mesh, *, sequence_parallel: bool = False, compiled: bool = False) -> None:
    """Megatron layout: wq/wk/wv/w1/w3 column-parallel, wo/w2 row-parallel; MoE experts
    stay whole on every TP rank (each computes them alike). The projections reading one
    input have its gradient reduced once, summed (``ConsumersInput``).
    ``sequence_parallel`` (dense models): the blocks' residual stream split along the
    sequence, one gather of each normed input for its column-parallel consumers (quantized
    in eager blocks, high precision in ``compiled`` ones), reduce-scatter after wo/w2
    (``launch.sequence_parallel``)."""
    require("tensor_parallel", TP_API, f"--tp {tp_mesh.size()}")
    from torch.distributed.tensor.parallel import parallelize_module

    from hybrid_dist import tensor_parallel as htp

    sp = sequence_parallel
    if sp and model.cfg.moe_experts:
        raise ValueError("sequence parallel: the MoE blocks' experts would each see a part of the tokens")
    shared = sp and not compiled  # the consumers read one quantized gather (PrepareHybridModuleInput)

    def col():  # a shared gather reduces its consumers' summed gradient itself; else ConsumersInput does
        return htp.HybridColwiseParallel(sequence_parallel=shared, reduce_input_grad=shared)

    plan = {f"attention.{n}": col() for n in ("wq", "wk", "wv")}
    plan["attention.wo"] = htp.HybridRowwiseParallel(sequence_parallel=sp)
    parents = {"attention": ("wq", "wk", "wv")}
    if not model.cfg.moe_experts:
        plan.update({"feed_forward.w1": col(), "feed_forward.w3": col(),
                     "feed_forward.w2": htp.HybridRowwiseParallel(sequence_parallel=sp)})
        parents["feed_forward"] = ("w1", "w3")
    if shared:
        plan.update({p: htp.PrepareHybridModuleInput(consumers=c) for p, c in parents.items()})
    group = tp_mesh.get_group()
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, plan)
        block.attention.seq_first = sp
        if not shared:
            for name in parents:
                block.get_submodule(name).register_forward_pre_hook(ConsumersInput(group, sequence_parallel=sp))
    model.sp_group = group if sp else None


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """Every block's expert ``GroupedLinear``s (empty for dense models)."""
    if not model.cfg.moe_experts:
        return []
    return [m for block in model.layers.values() for m in block.feed_forward.expert_modules()]


def advances_delayed_state(model: nn.Module) -> bool:
    """True if a module's forward advances a delayed-scaling state (``advances_state`` of its
    plans): a compiled activation recompute would recompute that advance from the already
    advanced state, and quantize the backward's operands with other scales than the forward's."""
    return any(plan.advances_state for m in model.modules() for plan in getattr(m, "_plans", {}).values())


def compiled_recompute_refusal(model: nn.Module, dims: ParallelDims) -> str | None:
    """Why the blocks cannot compile under activation recompute (a checkpoint is one
    higher-order op, which Dynamo traces whole or not at all), or None."""
    if dims.ep > 1:
        return "the expert-parallel exchange runs eagerly (host split sizes), and a compiled checkpoint cannot break"
    if dims.tp > 1:
        return ("the tensor-parallel linears keep their device mesh for backward, which AOTAutograd cannot save "
                "inside a compiled checkpoint")
    if advances_delayed_state(model):  # (not hoisted: ``hoisted_advance``)
        return ("the blocks advance delayed-scaling states in their forward, which a compiled recompute would "
                "read advanced")
    return None


def apply_ac(model: nn.Module) -> None:
    """Full activation checkpointing of every block (non-reentrant)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for name, block in list(model.layers.items()):
        model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)


def reshards_after_forward(policy: str, unit: int, n_units: int) -> bool:
    """Whether FSDP unit ``unit`` of ``n_units`` is resharded after its forward under
    ``policy`` (``--reshard-after-forward``): ``default`` every unit but the last (whose
    backward comes right after), ``always`` every unit, ``never`` none."""
    if policy not in RESHARD_POLICIES:
        raise ValueError(f"reshard policy must be one of {', '.join(RESHARD_POLICIES)}, got {policy!r}")
    return policy == "always" or (policy == "default" and unit < n_units - 1)


# --fsdp-unit 0: a unit holds at least this many parameters (the 8b's block alone; four of the 1b's)
AUTO_UNIT_PARAMS = 200_000_000


def blocks_per_unit(model: nn.Module, requested: int) -> int:
    """Consecutive blocks per FSDP unit: ``requested`` (``--fsdp-unit``), or for 0 the fewest
    whose parameters reach ``AUTO_UNIT_PARAMS`` (counted at full size, so the answer is the
    same before and after sharding), at most a quarter of the blocks so that gathers still
    overlap compute. The 8b's blocks stay one per unit, the 1b's go four to a unit."""
    if requested:
        return requested
    blocks = list(model.layers.values())
    largest = max(sum(p.numel() for p in b.parameters()) for b in blocks)
    return max(1, min(-(-AUTO_UNIT_PARAMS // max(largest, 1)), len(blocks) // 4))


def fsdp_units(model: nn.Module, requested: int = 1) -> list[list[nn.Module]]:
    """The model's blocks in FSDP units of ``blocks_per_unit(model, requested)`` consecutive
    blocks (``--fsdp-unit``; the last unit may hold fewer)."""
    n = blocks_per_unit(model, requested)
    blocks = list(model.layers.values())
    return [blocks[i:i + n] for i in range(0, len(blocks), n)]


def expert_groups(units: list[list[nn.Module]], experts: list[nn.Module]) -> list[list[nn.Module]]:
    """The expert modules of each FSDP unit's blocks, one list per unit that has any (an
    expert outside every unit forms a group of its own): each list is sharded as one FSDP2
    group, so a unit's experts cost one all-gather, one reduce-scatter and FSDP2's
    per-group host work, like its blocks."""
    groups, seen = [], set()
    for unit in units:
        inside = {id(m) for block in unit for m in block.modules()}
        group = [m for m in experts if id(m) in inside]
        seen.update(id(m) for m in group)
        if group:
            groups.append(group)
    return groups + [[m] for m in experts if id(m) not in seen]


def apply_fsdp(model: nn.Module, fsdp_mesh, *, param_dtype: torch.dtype, cpu_offload: bool,
               experts: list[nn.Module] = (), expert_mesh=None, dp_degree: int = 1,
               reshard: str = "default", blocks_per_unit: int = 1, prefetch: int = 0) -> None:
    """``fully_shard`` each unit of ``blocks_per_unit`` blocks (``fsdp_units``), then the
    root (embedding, norm, head). Applied even on one rank, where it only casts parameters
    to ``param_dtype`` for compute. A unit of several blocks is one FSDP2 parameter group:
    one all-gather, one reduce-scatter and FSDP2's per-group host work serve all of them.

    ``prefetch`` (``--fsdp-prefetch``) > 0: each unit, and the root, issue the forward
    all-gathers of the next ``prefetch`` units from the host as soon as their own are copied
    out (FSDP2's explicit forward prefetch), not at those units' own pre-forward: a host that
    runs late then still starts each gather a unit ahead.

    ``reshard`` (``reshards_after_forward``): under ``"never"`` (no expert group resharded
    either) the backward gathers nothing, and each block's unsharded weights stay in memory
    from its forward to its backward (quantized weights gather both directions in forward;
    per-tensor FP8 sends its codes once).

    With expert parallelism, each rank's experts are different parameters: they shard over
    ``expert_mesh`` (the FSDP ranks holding the same experts), the expert modules of a unit's
    blocks as one FSDP2 group (``expert_groups``), and their gradients, which already sum the
    tokens of the whole EP group, are divided by the full ``dp_degree``."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    kw = dict(mesh=fsdp_mesh, mp_policy=mp)
    if cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    units = fsdp_units(model, blocks_per_unit)
    if expert_mesh is not None:
        for group in expert_groups(units, experts):
            fully_shard(group if len(group) > 1 else group[0], **{**kw, "mesh": expert_mesh},
                        reshard_after_forward=reshard != "never")
            for mod in group:  # one FSDP2 state serves the group; set through each module alike
                mod.set_gradient_divide_factor(float(dp_degree))
                if expert_mesh.device_type == "cpu" and expert_mesh.size() > 1:  # gloo has no PREMUL_SUM
                    mod.set_force_sum_reduction_for_comms(True)
    for i, unit in enumerate(units):
        fully_shard(unit if len(unit) > 1 else unit[0], reshard_after_forward=reshards_after_forward(
            reshard, i, len(units)), **kw)
    fully_shard(model, **kw)
    if prefetch:
        heads = [unit[0] for unit in units]  # a unit's modules share one FSDP2 state
        model.set_modules_to_forward_prefetch(heads[:prefetch])
        for i, head in enumerate(heads):
            head.set_modules_to_forward_prefetch(heads[i + 1:i + 1 + prefetch])


def all_gather_bytes_per_step(model, dims: ParallelDims, param_dtype_bytes: int, *, skip_quantized: bool,
                              reshard: str = "default", blocks_per_unit: int = 1) -> int:
    """Estimated all-gather output bytes per rank per step (the unsharded parameters, as
    ``hybrid_dist.fsdp2`` counts them): each FSDP unit in forward and, where ``reshard``
    (``--reshard-after-forward``) reshards it, again in backward; the root once. HSDP gathers
    over ``dp_shard`` only. ``skip_quantized``: leave out quantized parameters (measured)."""
    if dims.fsdp == 1:
        return 0

    def gathered(params) -> int:  # local shard x fsdp = the TP-local unsharded size, in bytes
        locals_ = [p.to_local() if isinstance(p, DTensor) else p for p in params]
        # torchao float8 weights gather as float8 (1 byte per element)
        return sum(t.numel() * dims.fsdp * (1 if torchao_baseline.is_float8_weight(t) else param_dtype_bytes)
                   for t in locals_ if not (skip_quantized and isinstance(t, hd.QuantizedTensor)))

    units = fsdp_units(model, blocks_per_unit)
    total = sum(gathered(p for b in unit for p in b.parameters())
                * (1 + reshards_after_forward(reshard, i, len(units))) for i, unit in enumerate(units))
    block_ids = {id(p) for unit in units for b in unit for p in b.parameters()}
    total += gathered(p for p in model.parameters() if id(p) not in block_ids)
    return total


def needs_fsdp(cfg: TrainConfig, dims: ParallelDims, param_dtype: torch.dtype) -> bool:
    """FSDP2 shards over dp ranks, casts for mixed precision and offloads to CPU; on one
    fp32 rank without offload it has nothing to do."""
    return dims.dp > 1 or param_dtype != torch.float32 or cfg.cpu_offload


def parallelize(model: nn.Module, cfg: TrainConfig, dims: ParallelDims, meshes: Meshes, *,
                param_dtype: torch.dtype, device_type: str) -> nn.Module:
    if dims.tp > 1:
        apply_tp(model, meshes.tp, sequence_parallel=cfg.sequence_parallel, compiled=cfg.compile)
    experts = expert_modules(model)  # before AC/compile wrap the blocks
    if cfg.activation_checkpointing:
        apply_ac(model)
    if cfg.compile and cfg.activation_checkpointing and dims.ep == 1 and dims.tp == 1:
        hoist_delayed_advance(model)  # delayed scaling's advance in the root's pre-hook, outside the checkpoints
    eager = compiled_recompute_refusal(model, dims) if cfg.compile and cfg.activation_checkpointing else None
    if eager is not None:
        warn_once(f"--compile with --activation-checkpointing: {eager}; the blocks run eagerly (compile "
                  "without recompute to compile them)")
    elif cfg.compile:
        for name, block in list(model.layers.items()):
            model.layers[name] = torch.compile(block, options=hd.compile_options())
    if cfg.cpu_offload and device_type != "cuda":
        raise ValueError("--cpu-offload moves sharded parameters to CPU between uses; it needs a CUDA device")
    if needs_fsdp(cfg, dims, param_dtype):
        fsdp_copy_in.choose(cfg.fsdp_copy_in)  # process-wide: the flag of this run decides
        apply_fsdp(model, meshes.fsdp, param_dtype=param_dtype, cpu_offload=cfg.cpu_offload, experts=experts,
                   expert_mesh=meshes.ep_fsdp if dims.ep > 1 else None, dp_degree=dims.dp,
                   reshard=cfg.reshard_after_forward, blocks_per_unit=cfg.fsdp_unit,
                   prefetch=cfg.fsdp_prefetch)
    return model
