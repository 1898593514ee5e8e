"""The launcher's expert parallelism with FSDP2 units, activation recompute and EP below the
FSDP degree (gloo ranks).

* Experts sharded per FSDP unit (``launch.parallelize.expert_groups``): the expert modules
  of a unit's blocks form one FSDP2 group, so ``--fsdp-unit N`` groups them as it groups
  the blocks, and the losses do not depend on the grouping.
* ``--activation-checkpointing`` with EP and ``--quantized-init``: an expert group nests in
  a checkpointed block but shards over its own mesh; its recomputed forward is recognised
  (``fsdp2._pass``) and gathers both directions, so the run trains bitwise like the run
  without recompute.
* EP below the FSDP degree (EP=2 × FSDP 4, 4 ranks): the gradient-norm all-reduces run in
  one order on every rank (``launch.grad_clip``), the experts' reduce-scatter works on
  gloo, and the run trains like EP=1.
"""

from __future__ import annotations

import torch
from torch import nn

from tests_distributed._harness import run_ranks
from tests_distributed.test_launch_train import STEPS, _cfg, ep_losses_differ


def _block(experts: int = 2) -> nn.Module:
    block = nn.Module()
    block.attn = nn.Linear(2, 2)
    block.experts = nn.ModuleList(nn.Linear(2, 2) for _ in range(experts))
    return block


def test_expert_groups_follow_the_units():
    from hybrid_dist.launch.parallelize import expert_groups, fsdp_units

    model = nn.Module()
    model.layers = nn.ModuleDict({str(i): _block() for i in range(5)})
    blocks = list(model.layers.values())
    experts = [m for b in blocks for m in b.experts]
    loose = nn.Linear(2, 2)  # an expert module outside every block: a group of its own
    assert expert_groups(fsdp_units(model), experts) == [list(b.experts) for b in blocks]
    assert expert_groups(fsdp_units(model, 2), experts + [loose]) == [experts[0:4], experts[4:8], experts[8:10],
                                                                      [loose]]
    assert expert_groups(fsdp_units(model, 8), experts) == [experts]
    assert expert_groups(fsdp_units(model), []) == []


def _unit_runs(rank, world_size):
    """Per ``--fsdp-unit``: the losses and, per ``fully_shard`` call on expert modules, how
    many modules it grouped (in call order)."""
    from hybrid_dist.launch import parallelize
    from hybrid_dist.launch.loop import train
    from hybrid_dist.moe import GroupedLinear

    real, calls = parallelize.fully_shard, []

    def counting(module, **kw):
        mods = module if isinstance(module, list) else [module]
        if isinstance(mods[0], GroupedLinear):
            calls.append(len(mods))
        return real(module, **kw)

    parallelize.fully_shard = counting
    out = {}
    for unit in (1, 2, 4):
        calls.clear()
        losses = train(_cfg("fp8_current", moe_experts=4, ep=2, layers=4, fsdp_unit=unit))["losses"]
        out[unit] = (losses, list(calls))
    return out


def test_ep_experts_shard_per_unit_and_train_bitwise_alike():
    """EP=2 × FSDP 2, 4 MoE blocks: units of 1, 2 and 4 blocks shard each unit's expert
    modules (fc1 and fc2 of its blocks) as one group, and the losses are bitwise alike."""
    r0, r1 = run_ranks(_unit_runs, 2)
    for rank, r in enumerate((r0, r1)):
        where = f"fp8_current tiny layers=4 moe_experts=4 ep=2 fsdp=2 gloo rank {rank}"
        (l1, c1), (l2, c2), (l4, c4) = (r[u] for u in (1, 2, 4))
        assert (c1, c2, c4) == ([2] * 4, [4] * 2, [8]), f"{where}: expert modules per group {c1} / {c2} / {c4}"
        assert l1 == l2 == l4 and len(l1) == STEPS, f"{where}: losses unit 1 {l1} / 2 {l2} / 4 {l4}"
        assert all(torch.isfinite(torch.tensor(l1))), f"{where}: losses {l1}"


def _recompute_runs(rank, world_size):
    from hybrid_dist.launch.loop import train

    kw = dict(moe_experts=4, ep=2, layers=2, quantized_init=True)
    return {ac: train(_cfg("fp8_current", activation_checkpointing=ac, **kw))["losses"] for ac in (False, True)}


def test_ep_recompute_of_quantized_experts_trains_like_without():
    r0, r1 = run_ranks(_recompute_runs, 2)
    for rank, r in enumerate((r0, r1)):
        where = f"fp8_current qinit tiny layers=2 moe_experts=4 ep=2 fsdp=2 gloo rank {rank}"
        assert len(r[True]) == STEPS and r[True] == r[False], (
            f"{where}: losses with --activation-checkpointing {r[True]}, without {r[False]}")


def _ep_vs_ep1_runs(rank, world_size):
    from hybrid_dist.launch.loop import train

    kw = dict(moe_experts=4, fsdp=4, batch_size=4)
    return {ep: train(_cfg("bf16", ep=ep, **kw))["losses"] for ep in (1, 2)}


def test_ep_below_the_fsdp_degree_trains_like_ep1():
    """EP=2 × FSDP 4 (each expert on 2 ranks, their gradients reduce-scattered over those 2
    and divided by the 4 data-parallel ranks; on gloo a sum, then the division, since gloo
    has no pre-multiplied sum) against EP=1 on the same 4 ranks: bf16, same init and data,
    only reduction orders differ (the bounds of ``test_launch_train``'s EP=2 vs EP=1 pair)."""
    r0, *_ = run_ranks(_ep_vs_ep1_runs, 4)
    differ = ep_losses_differ(r0[1], r0[2], "MoE bf16 fsdp=4 gloo")
    assert len(r0[2]) == STEPS and differ is None, differ or f"EP=2 losses {r0[2]}"
