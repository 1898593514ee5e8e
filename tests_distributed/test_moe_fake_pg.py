"""Fake process group (FakeStore, backend "fake"), EP = 64: the collectives one MoE step
issues, counted with CommDebugMode.

Per step: the counts all-to-all; the dispatch (forward) and combine (forward); in
backward the combine's gradient and the dispatch's gradient — 5 ``all_to_all_single``.
A quantized payload whose format has a per-tensor scale adds one ``all_reduce`` (MAX of
the ``[E]`` amax vector) before its all-to-all. The fake group moves no data (received
buffers are not filled), which is fine for counting.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.distributed.fake_pg import FakeStore

import hybrid_dist as hd
from hybrid_dist.moe import MoE

WORLD, E, H = 64, 128, 32
c10d = torch.ops.c10d


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=WORLD)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _counts(recipe_name, training, group):
    torch.manual_seed(0)
    moe = MoE(H, H, E, 2, recipe=hd.recipe_from_name(recipe_name), ep_group=group, dtype=torch.bfloat16)
    x = torch.randn(64, H, dtype=torch.bfloat16, requires_grad=training)
    with CommDebugMode() as comm, torch.set_grad_enabled(training):
        y, _ = moe(x)
        if training:
            y.float().sum().backward()
    per_op = comm.get_comm_counts()
    return {"all_to_all": per_op.get(c10d.alltoall_base_, 0), "all_reduce": per_op.get(c10d.allreduce_, 0)}, moe


@pytest.mark.parametrize("recipe_name,training,expected", [
    ("bf16", True, {"all_to_all": 5, "all_reduce": 0}),
    ("fp8_current", True, {"all_to_all": 5, "all_reduce": 2}),  # amax for x and for dy
    ("mxfp8", True, {"all_to_all": 5, "all_reduce": 0}),  # block scales only: no amax
    ("mxfp8", False, {"all_to_all": 3, "all_reduce": 0}),  # inference: no backward exchanges
    ("nvfp4", False, {"all_to_all": 3, "all_reduce": 1}),  # per-tensor global scale: amax
], ids=lambda v: str(v) if not isinstance(v, dict) else "")
def test_collectives_per_step_ep64(fake_world, recipe_name, training, expected):
    counts, moe = _counts(recipe_name, training, fake_world)
    assert counts == expected, f"EP={WORLD} recipe={recipe_name} training={training}: {counts} != {expected}"
    # the counts exchange: 63 peers x 2 local experts x int64
    assert moe.wire.bytes["counts"] == (WORLD - 1) * (E // WORLD) * 8
