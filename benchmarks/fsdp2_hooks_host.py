"""Host microseconds of FSDP2's unshard / reshard of one block of quantized weights, and the
share spent in this package's all-gather hooks (``fsdp_pre_all_gather`` +
``fsdp_post_all_gather``). One process on the fake process group (world 2): collectives
are no-ops, so the figures are the host cost of a gather, on any machine, CPU included.

A block is ``LAYERS`` ``hd.Linear(DIM, DIM)`` with ``hd.quantized_model_init`` weights (bf16:
``nn.Linear``) under ``fully_shard``, inside a root ``fully_shard`` (so the block reshards
after forward, as the launcher's blocks do). Forward cycles gather the rowwise direction,
backward cycles (FSDP's ``PRE_BACKWARD`` state) the columnwise one. Best of ``--repeats``
timings of ``--cycles`` cycles. Run: ``python -m benchmarks.fsdp2_hooks_host``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
from torch.testing._internal.distributed.fake_pg import FakeStore

import hybrid_dist as hd
from benchmarks._bench import print_table
from hybrid_dist import quantized_tensor

HOOK_SECONDS = {"pre": 0.0, "post": 0.0}


def _time_hooks() -> None:
    """Wrap the installed hooks so that each call adds its duration to ``HOOK_SECONDS``."""
    for kind in ("pre", "post"):
        fn = quantized_tensor._FSDP_HOOKS[kind]

        def timed(*args, _fn=fn, _kind=kind, **kwargs):
            t0 = time.perf_counter()
            out = _fn(*args, **kwargs)
            HOOK_SECONDS[_kind] += time.perf_counter() - t0
            return out

        quantized_tensor._FSDP_HOOKS[kind] = timed


def _block(recipe: str, layers: int, dim: int) -> torch.nn.Module:
    torch.manual_seed(0)
    if recipe == "bf16":
        block = torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False) for _ in range(layers)]).bfloat16()
    else:
        r = hd.recipe_from_name(recipe)
        with hd.quantized_model_init(r, keep_high_precision_init=False):
            block = torch.nn.Sequential(*[hd.Linear(dim, dim, bias=False, recipe=r) for _ in range(layers)])
    fully_shard(block)
    root = torch.nn.Sequential(block)
    fully_shard(root)
    x = torch.randn(128, dim, dtype=torch.bfloat16, requires_grad=True)
    root(x).float().sum().backward()  # lazy init and the first gathers of both passes
    return block


def measure(recipe: str, *, layers: int, dim: int, cycles: int, repeats: int) -> list[list]:
    group = fully_shard.state(_block(recipe, layers, dim))._fsdp_param_group
    rows = []
    for name, state in (("forward", TrainingState.FORWARD), ("backward", TrainingState.PRE_BACKWARD)):
        def cycle():
            group._training_state = state
            group.unshard()
            group.wait_for_unshard()
            group.reshard()

        for _ in range(20):
            cycle()
        best = None
        for _ in range(repeats):
            HOOK_SECONDS.update(pre=0.0, post=0.0)
            t0 = time.perf_counter()
            for _ in range(cycles):
                cycle()
            total = (time.perf_counter() - t0) / cycles * 1e6
            per = {k: v / cycles / layers * 1e6 for k, v in HOOK_SECONDS.items()}
            if best is None or total < best[0]:
                best = (total, per)
        total, per = best
        rows.append([recipe, name, f"{total:.0f}", f"{per['pre'] + per['post']:.1f}", f"{per['pre']:.1f}",
                     f"{per['post']:.1f}"])
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipes", default="bf16,fp8_current,mxfp8,nvfp4")
    p.add_argument("--layers", type=int, default=7)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--cycles", type=int, default=100)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    _time_hooks()
    rows = [row for r in args.recipes.split(",")
            for row in measure(r, layers=args.layers, dim=args.dim, cycles=args.cycles, repeats=args.repeats)]
    print_table(["recipe", "pass", f"cycle of {args.layers} params (us)", "hooks per param (us)", "pre", "post"], rows,
                f"FSDP2 unshard + reshard host time, {args.layers} x [{args.dim}, {args.dim}], fake process group")


if __name__ == "__main__":
    main()
