"""``fsdp2.grad_copy_in``: the gradient copy-in equals ``torch._chunk_cat`` byte for byte
(rank counts, uneven and empty rows, dtypes)."""

from __future__ import annotations

import pytest
import torch

from hybrid_dist.fsdp2 import grad_copy_in

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
