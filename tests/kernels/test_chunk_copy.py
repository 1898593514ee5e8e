"""``kernels.chunk_copy`` under the Triton interpreter on CPU: FSDP2's gradient copy-in through
the kernel (``fsdp2.grad_copy_in.copy_in``, one launch per gradient) writes the bytes of
``torch._chunk_cat`` for 1, 2, 3 and 8 ranks, rows that do not divide by the rank count, a
gradient smaller than one chunk, non-contiguous gradients and every exact cast; and the
kernel refuses a cast that would round."""

from __future__ import annotations

import pytest
import torch

from tests._helpers import run_under_triton_interpreter

SHAPES = [(7, 5), (8, 3), (3,), (1, 4), (2, 3, 4), (5, 1), (16,), (0, 4), (2500, 3)]


def _check():
    from hybrid_dist.fsdp2 import grad_copy_in
    from hybrid_dist.kernels import chunk_copy

    calls = []
    real = chunk_copy.copy_chunks
    chunk_copy.copy_chunks = lambda *a: calls.append(1) or real(*a)
    grad_copy_in._chunk_kernel = lambda out: chunk_copy  # CPU tensors: the kernel the CUDA path takes
    for src, dst in ((torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                     (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)):
        for w in (1, 2, 3, 8):
            gen = torch.Generator().manual_seed(w)
            grads = [torch.randn(s, generator=gen).to(src) for s in SHAPES]
            grads.append(torch.randn(6, 4, generator=gen).to(src).t())
            numel = sum(-(-g.shape[0] // w) * w * (g[0].numel() if g.shape[0] else 0) for g in grads)
            want = torch.full((numel,), float("nan"), dtype=dst)
            got = torch.full((numel,), float("nan"), dtype=dst)
            torch._chunk_cat([g for g in grads if g.shape[0]], 0, w, out=want.view(w, -1))
            before = len(calls)
            grad_copy_in.copy_in(grads, got, w)
            bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[dst]
            assert torch.equal(got.view(bits), want.view(bits)), (src, dst, w)
            assert len(calls) - before == sum(1 for g in grads if g.shape[0]), (src, dst, w)
    with pytest.raises(ValueError, match="exact cast"):
        chunk_copy.copy_chunks(torch.ones(4), torch.zeros(2, 2, dtype=torch.bfloat16), 0, 2)


def test_copy_in_through_the_kernel_bitwise_chunk_cat():
    run_under_triton_interpreter("from tests.kernels.test_chunk_copy import _check; _check(); print('chunk_copy ok')",
                                 done="chunk_copy ok", timeout=600)


@pytest.mark.gpu
@pytest.mark.parametrize("w", [1, 2, 4, 8])
def test_copy_in_on_cuda_bitwise_chunk_cat(w):
    """On the GPU: ``copy_in`` (``kernels.chunk_copy``, bf16 gradients into fp32) writes the
    bytes of ``torch._chunk_cat``, with large gradients (several blocks per chunk)."""
    from hybrid_dist.fsdp2 import grad_copy_in

    gen = torch.Generator(device="cuda").manual_seed(w)
    shapes = SHAPES + [(4096, 1024), (14336, 4096), (4097,)]
    grads = [torch.randn(s, generator=gen, device="cuda").bfloat16() for s in shapes]
    numel = sum(-(-g.shape[0] // w) * w * (g[0].numel() if g.shape[0] else 0) for g in grads)
    want = torch.full((numel,), float("nan"), device="cuda")
    got = torch.full((numel,), float("nan"), device="cuda")
    torch._chunk_cat([g for g in grads if g.shape[0]], 0, w, out=want.view(w, -1))
    grad_copy_in.copy_in(grads, got, w)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), w
