"""``overlap_chunks``: the sequence-parallel fprops in overlapped chunks (``tensor_parallel._overlap``)
compute what the unchunked layers compute, on 2 gloo ranks.

A TP+SP MLP (``fc1`` column-parallel, GELU, ``fc2`` row-parallel) with ``overlap_chunks``
∈ {2, 4} against the same MLP unchunked, two steps (delayed scaling reads step 0's history
in step 1): the output and every gradient bitwise equal, eagerly and compiled
(``aot_eager``, no graph break); the wire log shows the chunks — ``fc1``'s quantized rows
gathered in ``C`` all-gathers and ``fc2``'s output reduce-scattered in ``C``, the same bytes in
all — for the chunkable formats (per-tensor FP8, high precision), and one of each for MXFP8,
which runs unchunked.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests_distributed._harness import run_ranks

S, H, FFN = 64, 64, 128  # rows 32 per rank: divisible by 2 x 4 chunks and by FP8/MXFP8 blocks
RECIPES = ("bf16", "fp8_current", "fp8_delayed", "mxfp8")
CHUNKED = ("bf16", "fp8_current", "fp8_delayed")


class MLP(nn.Module):
    def __init__(self, recipe):
        super().__init__()
        import hybrid_dist as hd

        self.fc1 = hd.Linear(H, FFN, bias=False, recipe=recipe, name="fc1")
        self.fc2 = hd.Linear(FFN, H, bias=False, recipe=recipe, name="fc2")

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _run(recipe_name, chunks, compiled, rank, world, device="cpu"):  # noqa: PLR0913
    """``(outputs and gradients of two steps, wire events of the first step)``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import hybrid_dist as hd
    from hybrid_dist.tensor_parallel import HybridColwiseParallel, HybridRowwiseParallel, record_wire_bytes

    torch.manual_seed(0)
    model = MLP(hd.recipe_from_name(recipe_name)).to(device)
    mesh = init_device_mesh(device, (world,))
    parallelize_module(model, mesh, {"fc1": HybridColwiseParallel(sequence_parallel=True, overlap_chunks=chunks),
                                     "fc2": HybridRowwiseParallel(sequence_parallel=True, overlap_chunks=chunks)})
    torch._dynamo.reset()  # one compile per model (every model shares MLP.forward's code object)
    backend = "inductor" if device == "cuda" else "aot_eager"
    run = torch.compile(model, backend=backend, fullgraph=True) if compiled else model
    results, events = [], None
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(S, 1, H, generator=g).bfloat16().chunk(world)[rank].to(device).requires_grad_()
        dy = torch.randn(S, 1, H, generator=g).bfloat16().chunk(world)[rank].to(device)
        with record_wire_bytes() as log:
            y = run(x)
            y.backward(dy)
        events = events or [(e.kind, e.what, e.nbytes) for e in log.events]
        results.append([y.detach(), x.grad] + [p.grad.to_local().clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
    return results, events


def _rank_fn(rank, world, recipes, compiled, device="cpu"):
    import warnings

    warnings.simplefilter("ignore")
    out, fails = {}, []
    for name in recipes:
        ref, ref_events = _run(name, 0, compiled, rank, world, device)
        for chunks in (2, 4):
            got, events = _run(name, chunks, compiled, rank, world, device)
            where = f"[{name} TP={world} SP overlap_chunks={chunks} {'compiled' if compiled else 'eager'}]"
            for step, (a, b) in enumerate(zip(got, ref)):
                for i, (u, v) in enumerate(zip(a, b)):
                    if not torch.equal(u, v):
                        what = ("output", "grad x", "grad fc1.weight", "grad fc2.weight")[i]
                        fails.append(f"{where} step {step}: {what} differs from unchunked by "
                                     f"{(u.float() - v.float()).abs().max():.3g}")
            out[(name, chunks)] = (events, ref_events)
    return fails, out


def _forward_collectives(events, kind):
    return [n for k, what, n in events if k == kind and what in ("rowwise", "high_precision")]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_overlapped_chunks_equal_unchunked(compiled):
    (fails, out), _ = run_ranks(_rank_fn, 2, RECIPES, compiled)
    assert not fails, "\n".join(fails)
    if compiled:
        return  # compiled code logs no wire events
    for (name, chunks), (events, ref) in out.items():
        where = f"[{name} TP=2 SP overlap_chunks={chunks}]"
        n = chunks if name in CHUNKED else 1
        for kind in ("all_gather", "reduce_scatter"):
            got, want = _forward_collectives(events, kind), _forward_collectives(ref, kind)
            fwd = len(want) - 1  # the backward's own collective of this kind is the last one
            assert sum(got) == sum(want), f"{where}: {kind} bytes {got} != unchunked {want}"
            assert len(got) == fwd + n, f"{where}: {len(got)} {kind}s, expected {n} forward chunks + {fwd}: {events}"

