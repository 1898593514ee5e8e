"""An expert-parallel MoE layer under ``torch.compile`` (2 gloo ranks, ``aot_eager``).

The exchange reads its all-to-all split sizes on the host and hands the received operands
to the expert layers through an opaque ``ExchangeIO``, so it runs eagerly: one graph
break per MoE forward, the router, the permutation and the unpermutation compiled around
it. Asserted over steps that route the tokens differently (the received row counts
change): the frames compiled in the first step are all there are (no recompile for a new
routing), and outputs, input gradients and every parameter gradient are bitwise the eager
layer's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hybrid_dist as hd
from hybrid_dist.moe import MoE
from tests_distributed._harness import run_ranks

H, FFN, E, TOP_K, T, STEPS = 64, 64, 4, 2, 32, 3


def _bitwise(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16)) \
        if a.dtype == torch.bfloat16 else torch.equal(a, b)


def _layer(recipe):
    torch.manual_seed(0)
    return MoE(H, FFN, E, TOP_K, recipe=recipe, ep_group=dist.group.WORLD, dtype=torch.bfloat16)


def _steps(layer, fn, rank):
    out = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(T, H, generator=g).to(torch.bfloat16).requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        y, aux = fn(x)
        (y.float().square().mean() + aux).backward()
        out.append([y.detach(), aux.detach(), x.grad] + [p.grad for p in layer.parameters()])
    return out


def _compiled_vs_eager(rank, world, name):
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    recipe = hd.recipe_from_name(name)
    eager, compiled = _layer(recipe), _layer(recipe)
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(compiled, backend=counter)
    frames, seen = [], []
    eager.router.register_forward_hook(lambda mod, args, out: seen.append(tuple(out[1].flatten().tolist())))

    def step_fn(x):
        r = fn(x)
        frames.append(counter.frame_count)
        return r

    ref = _steps(eager, eager, rank)
    got = _steps(compiled, step_fn, rank)
    mismatches = [f"step {step} output {i}" for step, (r, c) in enumerate(zip(ref, got))
                  for i, (a, b) in enumerate(zip(r, c)) if not _bitwise(a, b)]
    return dict(frames=frames, breaks=sum(counters["graph_break"].values()), mismatches=mismatches,
                distinct_routings=len(set(seen)))


@pytest.mark.parametrize("name", ["bf16", "fp8_current"])
def test_compiled_ep_layer_compiles_once_and_equals_eager(name):
    for rank, r in enumerate(run_ranks(_compiled_vs_eager, 2, name)):
        where = f"MoE EP=2 rank {rank} {name} (aot_eager)"
        assert r["distinct_routings"] == STEPS, f"{where}: the steps did not route differently"
        assert r["frames"][0] > 0 and r["frames"][-1] == r["frames"][0], (
            f"{where}: compiled frames after each step {r['frames']} (a new routing recompiled)")
        assert r["breaks"] >= 1, f"{where}: the exchange was traced ({r['breaks']} graph breaks)"
        assert not r["mismatches"], f"{where}: compiled differs from eager: {r['mismatches']}"
