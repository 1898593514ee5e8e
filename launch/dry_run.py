"""``--dry-run --world-size N``: validate a configuration for N ranks on one CPU, no training.

Checks, in order, each failing with a ``ValueError`` that names the configuration:
1. the parallel degrees (``hsdp * fsdp * tp == N``, ``ep | fsdp``, ``ep | experts``);
2. tensor-parallel divisibility (heads, kv heads, ffn dim);
3. block alignment: every ``hd.Linear``'s local weight ``[out, in]``, input ``[T, in]`` and
   output gradient ``[T, out]`` (T = batch·seq tokens per rank) under the recipe's
   quantizers, both directions;
then builds the real ``DeviceMesh`` on the fake process group, shards a meta-device model
with TP, EP and FSDP2 exactly as ``train`` does, and estimates memory per rank.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import hybrid_dist as hd
from hybrid_dist.launch.config import TrainConfig, load_recipe
from hybrid_dist.launch.mesh import ParallelDims
from hybrid_dist.launch.parallelize import EP_API, apply_fsdp, apply_tp, blocks_per_unit, expert_modules, require
from hybrid_dist.launch.presets import ModelConfig, preset

# (name, in_features, out_features, tensor-parallel split): "col" shards out, "row" shards in.
# MoE experts ("none") are not split by TP (every TP rank computes them alike).
def block_linears(m: ModelConfig) -> list[tuple[str, int, int, str]]:
    kv = m.n_kv_heads * m.head_dim
    attn = [("attention.wq", m.dim, m.dim, "col"), ("attention.wk", m.dim, kv, "col"),
            ("attention.wv", m.dim, kv, "col"), ("attention.wo", m.dim, m.dim, "row")]
    if m.moe_experts:
        return attn + [("feed_forward.moe.fc1", m.dim, 2 * m.ffn_dim, "none"),
                       ("feed_forward.moe.fc2", m.ffn_dim, m.dim, "none")]
    return attn + [("feed_forward.w1", m.dim, m.ffn_dim, "col"), ("feed_forward.w3", m.dim, m.ffn_dim, "col"),
                   ("feed_forward.w2", m.ffn_dim, m.dim, "row")]


def check_tp(m: ModelConfig, tp: int, where: str) -> None:
    for name, size in (("n_heads", m.n_heads), ("n_kv_heads", m.n_kv_heads), ("ffn_dim", m.ffn_dim)):
        if size % tp:
            raise ValueError(f"{where}: --tp {tp} must divide the model's {name}={size}; pick a tp degree that "
                             "divides it or another preset")


def check_alignment(m: ModelConfig, recipe: hd.Recipe, *, tp: int, tokens: int, where: str) -> list[str]:
    """Raise on a misaligned GEMM operand; return the checked shapes."""
    checked = []
    for name, k, n, split in block_linears(m):
        k_l, n_l = {"col": (k, n // tp), "row": (k // tp, n), "none": (k, n)}[split]
        mtype = "grouped_linear" if split == "none" else "linear"
        shapes = {"weight": (n_l, k_l), "input": (tokens, k_l), "grad_output": (tokens, n_l)}
        for ttype, (rows, cols) in shapes.items():
            if mtype == "grouped_linear" and ttype != "weight":
                continue  # per-expert token counts vary; the MoE layer pads its splits
            q = recipe.quantizer(hd.Role(tensor_type=ttype, module_type=mtype, name=f"layers.0.{name}"))
            for direction in ("rowwise", "columnwise"):
                try:
                    q.direction_quantizer(direction).check_shape(rows, cols, direction)
                except ValueError as e:
                    hint = ("; make --batch-size x --seq-len a multiple of the block" if ttype != "weight"
                            else "; pick a --tp that keeps local dims multiples of the block, or another recipe")
                    raise ValueError(
                        f"{where}: {name} {ttype} has local shape [{rows}, {cols}] (tp={tp}, tokens per rank="
                        f"{tokens}), which recipe {recipe.name!r} cannot quantize {direction}: {e}{hint}") from None
            checked.append(f"{name}.{ttype}[{rows},{cols}]")
    return checked


def fsdp_notes(m: ModelConfig, recipe: hd.Recipe, *, tp: int, fsdp: int) -> list[str]:
    """Weights whose FSDP shard rows do not fit the weight blocks (quantized all-gather falls back)."""
    notes = []
    for name, k, n, split in block_linears(m):
        rows = (n // tp if split == "col" else n) // max(fsdp, 1)
        if split == "none":
            continue  # expert weights shard over experts (dim 0 of [E, N, K]), not rows
        q = recipe.quantizer(hd.Role(tensor_type="weight", name=name))
        g = max(q.direction_quantizer(d).block_shape(d)[0] for d in ("rowwise", "columnwise"))
        if rows % g:
            notes.append(f"{name}: {rows} rows per FSDP shard is not a multiple of {g}; a quantized "
                         "all-gather of this weight falls back to high precision")
    return notes


def memory_estimate(m: ModelConfig, cfg: TrainConfig, dims: ParallelDims, local_params: int) -> dict[str, float]:
    """GiB per rank: fp32 params + grads + AdamW moments, gathered blocks, activations (rough)."""
    gib, act_b = 2**30, 2 if cfg.dtype != "fp32" else 4
    t, kv = cfg.batch_size * cfg.seq_len, m.n_kv_heads * m.head_dim
    mlp_mult = m.moe_top_k if m.moe_experts else 1
    per_layer = t * ((6 * m.dim + 2 * kv + 4 * m.ffn_dim * mlp_mult) // dims.tp) * act_b
    acts = (m.n_layers * t * m.dim * act_b + per_layer) if cfg.activation_checkpointing else m.n_layers * per_layer
    block = m.num_params(embeddings=False) // m.n_layers
    out = {"params_grads_optimizer": 16 * local_params / gib, "gathered_blocks": 2 * block * act_b / dims.tp / gib,
           "activations": acts / gib, "logits": 3 * t * m.vocab_size * 4 / gib}
    out["total"] = sum(out.values())
    return out


def _shard_on_fake_pg(m: ModelConfig, cfg: TrainConfig, dims: ParallelDims) -> tuple[int, list[str]]:
    """Build the mesh, parallelize a meta model as ``train`` would; return (local parameter
    count of rank 0, notes)."""
    from hybrid_dist.launch.model import Transformer, apply_recipe

    notes = []
    meshes = dims.build_meshes("cpu")
    if m.moe_experts:
        require("moe", EP_API, f"--moe-experts {m.moe_experts}")
    with torch.device("meta"):
        model = Transformer(m, ep_group=meshes.ep.get_group() if dims.ep > 1 else None)
    apply_recipe(model, load_recipe(cfg.recipe), share_quantized_inputs=cfg.links_quantized_inputs)
    if dims.tp > 1:
        apply_tp(model, meshes.tp, sequence_parallel=cfg.sequence_parallel, compiled=cfg.compile)
    apply_fsdp(model, meshes.fsdp, param_dtype=torch.bfloat16, cpu_offload=False, experts=expert_modules(model),
               expert_mesh=meshes.ep_fsdp if dims.ep > 1 else None, dp_degree=dims.dp,
               reshard=cfg.reshard_after_forward, blocks_per_unit=cfg.fsdp_unit)
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    unit = blocks_per_unit(model, cfg.fsdp_unit)
    notes.append(f"FSDP2 units of {unit} block{'s' if unit > 1 else ''}"
                 + ("" if cfg.fsdp_unit else " (--fsdp-unit 0: by block size)"))
    return local, notes


def dry_run(cfg: TrainConfig, *, world_size: int) -> dict:
    where = (f"dry run (world size {world_size}, preset {cfg.preset}, recipe {cfg.recipe}, hsdp={cfg.hsdp}, "
             f"fsdp={cfg.fsdp}, tp={cfg.tp}, ep={cfg.ep})")
    if world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {world_size}")
    dims = ParallelDims(world_size=world_size, hsdp=cfg.hsdp, fsdp=cfg.fsdp, tp=cfg.tp, ep=cfg.ep)
    m = preset(cfg.preset, moe_experts=cfg.moe_experts, moe_top_k=cfg.moe_top_k, layers=cfg.layers)
    if cfg.seq_len > m.max_seq_len:
        raise ValueError(f"{where}: --seq-len {cfg.seq_len} exceeds the preset's max_seq_len {m.max_seq_len}")
    if m.moe_experts and m.moe_experts % dims.ep:
        raise ValueError(f"{where}: --ep {dims.ep} must divide --moe-experts {m.moe_experts}")
    check_tp(m, dims.tp, where)
    recipe = load_recipe(cfg.recipe)
    checked = check_alignment(m, recipe, tp=dims.tp, tokens=cfg.batch_size * cfg.seq_len, where=where)
    if dist.is_initialized():
        raise RuntimeError("dry_run builds its own fake process group; call it with no process group active")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        local, notes = _shard_on_fake_pg(m, cfg, dims)
    finally:
        dist.destroy_process_group()
    return {"config": dataclasses.asdict(cfg), "world_size": world_size, "mesh": dataclasses.asdict(dims),
            "params_total": m.num_params(), "params_per_rank": local, "checked_operands": len(checked),
            "memory_gib_per_rank": memory_estimate(m, cfg, dims, local),
            "notes": notes + fsdp_notes(m, recipe, tp=dims.tp, fsdp=dims.fsdp)}


def format_report(r: dict) -> str:
    mesh = r["mesh"]
    mem = ", ".join(f"{k} {v:.2f}" for k, v in r["memory_gib_per_rank"].items())
    lines = [f"dry run OK for {r['world_size']} ranks: hsdp={mesh['hsdp']} x fsdp={mesh['fsdp']} x tp={mesh['tp']}"
             f" (ep={mesh['ep']} within fsdp)",
             f"  params: {r['params_total'] / 1e6:.1f}M total, {r['params_per_rank'] / 1e6:.2f}M per rank",
             f"  block alignment: {r['checked_operands']} GEMM operands fit recipe {r['config']['recipe']!r}",
             f"  memory estimate per rank (GiB): {mem}"]
    return "\n".join(lines + [f"  note: {n}" for n in r["notes"]])
