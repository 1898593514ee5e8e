"""``launch.fsdp_copy_in``: installing ``fsdp2.grad_copy_in.copy_in`` in FSDP2's place, and
FSDP2 with it installed giving the sharded gradients of FSDP2 without it (gloo, 2 and 3
ranks, parameters whose rows do not divide by the world size)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from hybrid_dist.launch import fsdp_copy_in
from tests_distributed._harness import run_ranks


def test_install_replaces_and_uninstall_restores():
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as fc

    original = fc.foreach_reduce_scatter_copy_in
    try:
        assert fsdp_copy_in.install() and fsdp_copy_in.install()  # idempotent
        assert fsdp_copy_in.installed() and fc.foreach_reduce_scatter_copy_in is not original
        assert fc.foreach_reduce_scatter_copy_in.hd_original is original
    finally:
        fsdp_copy_in.uninstall()
    assert fc.foreach_reduce_scatter_copy_in is original and not fsdp_copy_in.installed()



def test_choose_applies_the_flag_and_falls_back_only_under_auto(monkeypatch):
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as fc

    original = fc.foreach_reduce_scatter_copy_in
    try:
        assert fsdp_copy_in.choose("auto") and fsdp_copy_in.installed()
        assert not fsdp_copy_in.choose("torch") and fc.foreach_reduce_scatter_copy_in is original
        assert fsdp_copy_in.choose("hd") and fsdp_copy_in.installed()
        fsdp_copy_in.uninstall()
        # a torch whose foreach_reduce packs gradients some other way: auto keeps it, hd refuses
        monkeypatch.setattr(fc, "foreach_reduce_scatter_copy_in", lambda grads, out: None)
        assert not fsdp_copy_in.choose("auto") and not fsdp_copy_in.installed()
        with pytest.raises(ValueError, match="--fsdp-copy-in hd"):
            fsdp_copy_in.choose("hd")
    finally:
        monkeypatch.undo()
        fsdp_copy_in.uninstall()
    assert fc.foreach_reduce_scatter_copy_in is original


class _Odd(nn.Module):
    """Parameters whose rows do not divide by 2 or 3 ranks, a 1-D one and an embedding."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.a = nn.Linear(6, 7)
        self.b = nn.Linear(7, 5, bias=False)
        self.scale = nn.Parameter(torch.ones(5))

    def forward(self, tok):
        return (self.b(torch.relu(self.a(self.emb(tok)))) * self.scale).float().pow(2).mean()


def _sharded_grads(installed: bool, calls: list) -> list[torch.Tensor]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if installed:
        assert fsdp_copy_in.install()
    else:
        fsdp_copy_in.uninstall()
    torch.manual_seed(0)
    model = _Odd()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model.a, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    tok = torch.randint(0, 11, (4, 9), generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # gradients accumulate over two backwards
        model(tok).backward()
    out = [p.grad.to_local().clone() for p in model.parameters()]
    fsdp_copy_in.uninstall()
    return out


def _compare(rank, world_size):
    calls = []
    real = fsdp_copy_in.copy_in

    def counted(*args):
        calls.append(1)
        return real(*args)

    fsdp_copy_in.copy_in = counted
    try:
        ours = _sharded_grads(True, calls)
        n_calls = len(calls)
        theirs = _sharded_grads(False, calls)
    finally:
        fsdp_copy_in.copy_in = real
    assert n_calls == 4 and len(calls) == 4, f"rank {rank}/{world_size}: copy_in ran {n_calls}, then {len(calls)}"
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert torch.equal(a, b), f"rank {rank}/{world_size}: gradient of parameter {i} differs"
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp2_sharded_grads_equal_with_copy_in_installed(world_size):
    assert all(run_ranks(_compare, world_size))
