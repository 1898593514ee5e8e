"""``torch.compile`` of a checkpointed region (non-reentrant ``torch.utils.checkpoint``,
one higher-order op that Dynamo traces whole or not at all) with ``hd.Linear`` layers
that carry their own recipe, on CPU (backend ``aot_eager``).

* A recipe without forward state (``fp8_current``, ``mxfp8_fwd_nvfp4_bwd``): the layer
  keeps no Python side effect in its forward, so the region compiles with no graph break,
  and outputs and gradients are bitwise those of the same compiled function without
  recompute.
* Delayed scaling: the forward advances the amax history, which AOTAutograd's recompute
  would rerun from the advanced state; the layer then keeps a side effect, Dynamo runs the
  region eagerly (a graph break), and three steps are bitwise the eager recompute's.
* Delayed scaling with the advance hoisted into a forward pre-hook of the model that holds
  the checkpointed block (``hoisted_advance``; outside the checkpoint, as the launcher's
  root): the region compiles whole (one graph, no break) and three steps, and the amax
  histories and scales after them, are bitwise the eager recompute's; for a GroupedLinear
  (per-expert states) too.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import hybrid_dist as hd
from hybrid_dist.hoisted_advance import hoist_delayed_advance

K, N, T = 64, 64, 32


def _model(recipe_name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    recipe = hd.recipe_from_name(recipe_name)
    return torch.nn.Sequential(hd.Linear(K, N, recipe=recipe, name="a"), torch.nn.GELU(),
                               hd.Linear(N, K, recipe=recipe, name="b"))


def _steps(fn, model, steps: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        x = torch.randn(T, K, generator=gen).requires_grad_(True)
        y = fn(model, x)
        y.square().mean().backward()
        out += [y.detach(), x.grad] + [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
    return out


def _checkpointed(model, x):
    return checkpoint(model, x, use_reentrant=False)


def _plain(model, x):
    return model(x)


@pytest.mark.parametrize("recipe_name", ["fp8_current", "mxfp8_fwd_nvfp4_bwd"])
def test_checkpointed_region_compiles_whole(recipe_name):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = _model(recipe_name)
    ref = copy.deepcopy(model)
    got = _steps(torch.compile(_checkpointed, backend="aot_eager"), model)
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    want = _steps(torch.compile(_plain, backend="aot_eager"), ref)
    assert breaks == 0, f"{recipe_name}: {breaks} graph breaks in the compiled checkpoint"
    bad = [i for i, (a, b) in enumerate(zip(got, want)) if not torch.equal(a, b)]
    assert not bad, f"{recipe_name}: compiled with recompute differs from without at tensors {bad}"


def test_delayed_scaling_checkpoint_runs_eagerly_and_exact():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = _model("fp8_delayed")
    ref = copy.deepcopy(model)
    got = _steps(torch.compile(_checkpointed, backend="aot_eager"), model)
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    want = _steps(_checkpointed, ref)
    assert breaks > 0, "fp8_delayed: the compiled checkpoint did not break (its recompute would re-advance)"
    bad = [i for i, (a, b) in enumerate(zip(got, want)) if not torch.equal(a, b)]
    assert not bad, f"fp8_delayed: compiled checkpoint differs from the eager recompute at tensors {bad}"


class _Outer(torch.nn.Module):
    """The launcher's shape: a model whose blocks are checkpointed (and compiled) inside it,
    so its forward pre-hook runs outside every checkpoint."""

    def __init__(self, block: torch.nn.Module, call):
        super().__init__()
        self.block, self.call = block, call

    def forward(self, x):
        return self.call(self.block, x)


def test_hoisted_delayed_advance_compiles_whole_and_exact():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = _model("fp8_delayed")
    ref = copy.deepcopy(model)
    outer = _Outer(model, torch.compile(_checkpointed, backend="aot_eager"))
    assert hoist_delayed_advance(outer) == 2, "both fp8_delayed layers hoisted"
    got = _steps(lambda m, x: outer(x), model)
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    want = _steps(_checkpointed, ref)
    assert breaks == 0 and graphs == 1, f"fp8_delayed hoisted: {graphs} graphs, {breaks} breaks"
    bad = [i for i, (a, b) in enumerate(zip(got, want)) if not torch.equal(a, b)]
    assert not bad, f"fp8_delayed hoisted: compiled checkpoint differs from the eager recompute at tensors {bad}"
    for m, r in zip(model, ref):
        if isinstance(m, hd.Linear):
            for t in ("input", "weight", "grad_output"):
                a, b = m.plan_for(m.recipe).states[t], r.plan_for(r.recipe).states[t]
                assert torch.equal(a.amax_history, b.amax_history) and torch.equal(a.scale, b.scale), (m.name, t)


class _Experts(torch.nn.Module):
    """A GroupedLinear over a fixed split of the tokens (its delayed states are per expert)."""

    def __init__(self, recipe_name: str):
        super().__init__()
        from hybrid_dist.moe import GroupedLinear

        torch.manual_seed(0)
        self.fc = GroupedLinear(2, K, N, recipe=hd.recipe_from_name(recipe_name), name="experts")
        self.register_buffer("counts", torch.tensor([T // 4, T - T // 4]))

    def forward(self, x):
        return self.fc(x, self.counts)


def test_hoisted_delayed_advance_of_grouped_layers_is_exact():
    torch._dynamo.reset()
    model, ref = _Experts("fp8_delayed"), _Experts("fp8_delayed")
    outer = _Outer(model, torch.compile(_checkpointed, backend="aot_eager"))
    assert hoist_delayed_advance(outer) == 1, "the fp8_delayed GroupedLinear hoisted"
    got, want = _steps(lambda m, x: outer(x), model), _steps(_checkpointed, ref)
    bad = [i for i, (a, b) in enumerate(zip(got, want)) if not torch.equal(a, b)]
    assert not bad, f"fp8_delayed GroupedLinear hoisted: differs from the eager recompute at tensors {bad}"
    plan, ref_plan = model.fc.plan(model.fc.recipe), ref.fc.plan(ref.fc.recipe)
    for t in ("input", "weight"):
        for a, b in zip(plan.states[t], ref_plan.states[t]):
            assert torch.equal(a.amax_history, b.amax_history) and torch.equal(a.scale, b.scale), t


def test_hoisting_refuses_parallel_layers():
    model = _model("fp8_delayed")
    model[0]._hd_tp = object()  # what a tensor-parallel style sets
    with pytest.raises(ValueError, match="tensor- or expert-parallel"):
        hoist_delayed_advance(model)
