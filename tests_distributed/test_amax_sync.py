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


def _all_reduce_ops(rank, world):
    import torch.distributed as dist

    from hybrid_dist.all_reduce import all_reduce

    def compiled(x, op):  # the traced path: a functional all-reduce, a new tensor
        return all_reduce(x, dist.group.WORLD, op=op)[1]

    fn = torch.compile(compiled, backend="aot_eager", fullgraph=True)
    out = {}
    for op in ("sum", "max"):
        eager = torch.tensor([rank + 1.0, 5.0 - rank])
        all_reduce(eager, dist.group.WORLD, op=op)  # eagerly in place
        out[op] = (eager.tolist(), fn(torch.tensor([rank + 1.0, 5.0 - rank]), op).tolist())
    try:
        all_reduce(torch.zeros(1), dist.group.WORLD, op=dist.ReduceOp.MAX)
        out["bad"] = "no error"
    except ValueError as e:
        out["bad"] = str(e)
    return out


def test_all_reduce_sum_and_max_eager_and_compiled():
    """``all_reduce`` names its op by string (Dynamo on torch 2.11 cannot hash a
    ``dist.ReduceOp``): the same values eagerly and compiled, and a clear error otherwise."""
    for rank, out in enumerate(run_ranks(_all_reduce_ops, 2)):
        assert out["sum"] == ([3.0, 9.0], [3.0, 9.0]), f"rank {rank}: {out['sum']}"
        assert out["max"] == ([2.0, 5.0], [2.0, 5.0]), f"rank {rank}: {out['max']}"
        assert "op must be 'sum' or 'max'" in out["bad"], f"rank {rank}: {out['bad']}"
