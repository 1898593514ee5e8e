"""GPU, expert parallel over one NCCL rank: with ``fp8_current`` the received FP8 rows go
straight into the packed grouped GEMMs (``device_split.packed_fp8_rows``: ``io["x_packed"]``
in the forward, ``io["dy_packed"]`` in the backward), and the layer's output and every
gradient are bitwise those of the high-precision dispatch (which quantizes after the
exchange on the same packed path)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hybrid_dist as hd
from hybrid_dist.moe import MoE
from tests_distributed._harness import run_nccl

pytestmark = pytest.mark.gpu

H, FFN, E, TOP_K, T = 256, 256, 4, 2, 512


def _bits(t):
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _step(quantized):
    torch.manual_seed(0)
    moe = MoE(H, FFN, E, TOP_K, recipe=hd.recipe_from_name("fp8_current"), ep_group=dist.group.WORLD,
              quantized_dispatch=quantized, device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(True)
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    y, aux = moe(x)
    (y.float() * dy.float()).sum().add(aux).backward()
    grads = {n: p.grad for n, p in moe.named_parameters()}
    return {"y": y.detach(), "dx": x.grad, **grads}


def _compare(rank, world):
    import hybrid_dist.moe.device_split as ds

    calls = []
    place = ds.packed_fp8_rows
    ds.packed_fp8_rows = lambda *a, **k: calls.append(1) or place(*a, **k)
    quantized = _step(True)
    n_packed = len(calls)
    hp = _step(False)
    differ = {k: int((_bits(quantized[k]) != _bits(hp[k])).sum()) for k in hp}
    return n_packed, differ


def test_ep1_packed_quantized_dispatch_is_bitwise_the_hp_dispatch():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ((n_packed, differ),) = run_nccl(_compare, 1)
    assert n_packed == 2, f"EP=1 fp8_current: packed_fp8_rows ran {n_packed} times (dispatch fwd + combine bwd: 2)"
    assert not any(differ.values()), f"EP=1 fp8_current, quantized vs high-precision dispatch: elements differ {differ}"
