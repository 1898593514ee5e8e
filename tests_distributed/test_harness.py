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


def _parent_imports_present(rank, world_size):
    import sys

    return "hybrid_dist.fsdp2" in sys.modules  # imported by the test module's parent process only


def test_all_reduce_over_gloo():
    assert run_ranks(_sum_ranks, 2) == [1.0, 1.0]


def test_error_names_rank():
    with pytest.raises(AssertionError, match="rank 1"):
        run_ranks(_fail_on_one, 2)


def test_gloo_ranks_are_forked_with_the_parents_imports():
    # a spawned rank re-imports torch and hybrid_dist (10-25 s of CPU each on the CI machine)
    import hybrid_dist.fsdp2  # noqa: F401

    assert run_ranks(_parent_imports_present, 2) == [True, True]
