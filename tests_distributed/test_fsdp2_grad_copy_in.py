"""``fsdp2.grad_copy_in``: the gradient copy-in equals ``torch._chunk_cat`` byte for byte, and
FSDP2 with it installed gives the sharded gradients of FSDP2 without it (gloo, 2 and 3 ranks,
parameters whose rows do not divide by the world size)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from hybrid_dist.fsdp2 import grad_copy_in
from tests_distributed._harness import run_ranks

SHAPES = [(7, 5), (8, 3), (3,), (1, 4), (2, 3, 4), (5, 1), (16,), (0, 4)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("src,dst", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                     (torch.bfloat16, torch.bfloat16)])
def test_copy_in_bitwise_chunk_cat(world_size, src, dst):
    gen = torch.Generator().manual_seed(world_size)
    grads = [torch.randn(s, generator=gen).to(src) for s in SHAPES]
    grads.append(torch.randn(6, 4, generator=gen).to(src).t())  # not contiguous
    numel = sum(-(-g.shape[0] // world_size) * world_size * (g[0].numel() if g.shape[0] else 0) for g in grads)
    want = torch.full((numel,), float("nan"), dtype=dst)
    got = torch.full((numel,), float("nan"), dtype=dst)
    torch._chunk_cat([g for g in grads if g.shape[0]], 0, world_size, out=want.view(world_size, -1))
    grad_copy_in.copy_in(grads, got, world_size)
    assert torch.equal(got.view(torch.int16 if dst == torch.bfloat16 else torch.int32),
                       want.view(torch.int16 if dst == torch.bfloat16 else torch.int32)), (world_size, src, dst)


def test_copy_in_refuses_a_buffer_of_another_size():
    with pytest.raises(ValueError, match="fill 4 of 9"):
        grad_copy_in.copy_in([torch.ones(4, 2)], torch.zeros(18), 2)


def test_install_replaces_and_uninstall_restores():
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as fc

    original = fc.foreach_reduce_scatter_copy_in
    try:
        assert grad_copy_in.install() and grad_copy_in.install()  # idempotent
        assert grad_copy_in.installed() and fc.foreach_reduce_scatter_copy_in is not original
        assert fc.foreach_reduce_scatter_copy_in.hd_original is original
    finally:
        grad_copy_in.uninstall()
    assert fc.foreach_reduce_scatter_copy_in is original and not grad_copy_in.installed()


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
        assert grad_copy_in.install()
    else:
        grad_copy_in.uninstall()
    torch.manual_seed(0)
    model = _Odd()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model.a, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    tok = torch.randint(0, 11, (4, 9), generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # gradients accumulate over two backwards
        model(tok).backward()
    out = [p.grad.to_local().clone() for p in model.parameters()]
    grad_copy_in.uninstall()
    return out


def _compare(rank, world_size):
    calls = []
    real = grad_copy_in.copy_in

    def counted(*args):
        calls.append(1)
        return real(*args)

    grad_copy_in.copy_in = counted
    try:
        ours = _sharded_grads(True, calls)
        n_calls = len(calls)
        theirs = _sharded_grads(False, calls)
    finally:
        grad_copy_in.copy_in = real
    assert n_calls == 4 and len(calls) == 4, f"rank {rank}/{world_size}: copy_in ran {n_calls}, then {len(calls)}"
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert torch.equal(a, b), f"rank {rank}/{world_size}: gradient of parameter {i} differs"
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp2_sharded_grads_equal_with_copy_in_installed(world_size):
    assert all(run_ranks(_compare, world_size))
