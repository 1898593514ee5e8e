"""``all_reduce_amaxes``: one MAX all-reduce per group for any number of amaxes (gloo)."""

from __future__ import annotations

import torch

from hybrid_dist.amax_sync import all_reduce_amaxes
from tests_distributed._harness import run_ranks


def _reduce(rank, world):
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    local = [torch.tensor(float(rank + 1)), torch.tensor([10.0 - rank]), torch.tensor(0.0)]
    with CommDebugMode() as comm:
        out = all_reduce_amaxes(local, [dist.group.WORLD])
    none = all_reduce_amaxes(local, [])  # no group: the local values, no collective
    return out.tolist(), comm.get_total_counts(), none.tolist(), all_reduce_amaxes([], [dist.group.WORLD]).numel()


def test_one_all_reduce_gives_the_max_on_every_rank():
    for rank, (out, collectives, none, empty) in enumerate(run_ranks(_reduce, 3)):
        assert out == [3.0, 10.0, 0.0], f"rank {rank}: {out}"
        assert collectives == 1, f"rank {rank}: {collectives} collectives for 3 amaxes, expected 1"
        assert none == [rank + 1.0, 10.0 - rank, 0.0] and empty == 0, f"rank {rank}"
