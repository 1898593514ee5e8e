"""The gloo harness itself: ranks run, collectives work, errors name the rank."""

import pytest
import torch
import torch.distributed as dist

from tests_distributed._harness import run_ranks


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_one(rank, world_size):
    if rank == 1:
        raise RuntimeError("boom on purpose")
    return rank


def test_all_reduce_over_gloo():
    assert run_ranks(_sum_ranks, 2) == [1.0, 1.0]


def test_error_names_rank():
    with pytest.raises(AssertionError, match="rank 1"):
        run_ranks(_fail_on_one, 2)
