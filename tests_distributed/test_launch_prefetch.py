"""``--fsdp-prefetch N``: each FSDP2 unit (and the root) issues the forward all-gathers of
the next N units as soon as its own are copied out. Checked on 2 gloo ranks: when each
block's forward starts, N more units' all-gathers have been issued than under FSDP2's
implicit prefetch (which issues a unit's gather at its own pre-forward), and training is
bitwise the same (losses and all-gather bytes, also with activation recompute)."""

from __future__ import annotations

import json
import os

from tests_distributed._harness import run_ranks
from tests_distributed.test_launch_train import STEPS, _cfg

LAYERS = 4


def _gathers_at_block_starts(prefetch: int) -> list[int]:
    """All-gathers issued (FSDP2 param groups) when each of 4 blocks' forward starts."""
    import torch
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as group_mod
    from torch.distributed.device_mesh import init_device_mesh

    from hybrid_dist.launch.model import Transformer
    from hybrid_dist.launch.parallelize import apply_fsdp
    from hybrid_dist.launch.presets import preset

    torch.manual_seed(0)
    model = Transformer(preset("tiny", layers=LAYERS))
    apply_fsdp(model, init_device_mesh("cpu", (2,)), param_dtype=torch.float32, cpu_offload=False,
               prefetch=prefetch)
    issued, seen = [], []
    real = group_mod.foreach_all_gather

    def counting(*args, **kwargs):
        issued.append(1)
        return real(*args, **kwargs)

    group_mod.foreach_all_gather = counting  # this worker process only
    try:
        for block in model.layers.values():  # runs after FSDP2's pre-forward (registered first)
            block.register_forward_pre_hook(lambda *_: seen.append(len(issued)))
        model(torch.randint(0, model.cfg.vocab_size, (2, 16)))
    finally:
        group_mod.foreach_all_gather = real
    return seen


def _runs(rank, world_size, tmp):
    from hybrid_dist.launch.loop import train

    out = {"gathers": {n: _gathers_at_block_starts(n) for n in (0, 1, 2)}}
    for n, ac in ((0, False), (1, False), (2, False), (0, True), (1, True)):
        metrics = os.path.join(tmp, f"prefetch-{n}-{ac}.jsonl")
        losses = train(_cfg("fp8_current", quantized_init=True, layers=LAYERS, fsdp_unit=1, fsdp_prefetch=n,
                            activation_checkpointing=ac, metrics=metrics))["losses"]
        logged = [json.loads(line) for line in open(metrics)] if rank == 0 else []
        out[n, ac] = (losses, [r["ag_bytes"] for r in logged if r["event"] == "step"])
    return out


def test_prefetch_issues_gathers_a_unit_earlier_and_trains_alike(tmp_path):
    r0, _ = run_ranks(_runs, 2, str(tmp_path))
    where = "fp8_current qinit tiny layers=4 fsdp=2 gloo"
    # the root's gather, then each unit's at its own pre-forward (0), or N units ahead (capped at 1 + 4)
    assert r0["gathers"] == {0: [2, 3, 4, 5], 1: [3, 4, 5, 5], 2: [4, 5, 5, 5]}, f"{where}: {r0['gathers']}"
    for ac in (False, True):
        base = r0[0, ac]
        assert len(base[0]) == STEPS, f"{where}: {base}"
        for n in ((1, 2) if not ac else (1,)):
            assert r0[n, ac] == base, f"{where} recompute={ac}: --fsdp-prefetch {n} {r0[n, ac]} vs 0 {base}"
