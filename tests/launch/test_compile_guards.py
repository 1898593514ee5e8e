"""``launch.compile_guards``: which steps skip Dynamo's guard evaluation under
``--compile-guards steady``, that a skipped step really runs the compiled graph without
checking (a changed attribute goes unseen), and that the next check step stops the job."""

from __future__ import annotations

import pytest
import torch

from hybrid_dist.launch.compile_guards import GuardsChanged, SteadyGuards


def test_steps_that_skip():
    g = SteadyGuards("steady", start=0, warmup=2, check_every=4)
    assert [s for s in range(1, 13) if g.skips(s)] == [3, 5, 6, 7, 9, 10, 11], "warm-up 1-2, checks 4, 8, 12"
    resumed = SteadyGuards("steady", start=10, warmup=2, check_every=4)
    assert [s for s in range(11, 18) if resumed.skips(s)] == [13, 14, 15, 17]
    full = SteadyGuards("full", start=0, warmup=2, check_every=4)
    assert not any(full.skips(s) for s in range(1, 20))
    with pytest.raises(ValueError, match="full, steady"):
        SteadyGuards("sometimes", start=0, warmup=2, check_every=4)


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.factor = 2.0  # a Python float the trace specializes on: Dynamo guards it

    def forward(self, x):
        return x * self.factor


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def test_a_skipped_step_runs_the_old_graph_and_the_check_step_stops():
    torch._dynamo.reset()
    m = _Scaled()
    f = torch.compile(m, backend="eager")
    x = torch.ones(4)
    g = SteadyGuards("steady", start=0, warmup=2, check_every=4)
    for step in (1, 2):  # warm-up: compiles once
        with g.around(step):
            assert torch.equal(f(x), 2 * x)
        g.after_step(step, _graphs())
    compiled = _graphs()
    m.factor = 3.0  # what a guard watches changes ...
    with g.around(3):  # ... on a skipped step: the graph compiled for 2.0 runs, unchecked
        assert torch.equal(f(x), 2 * x), "step 3 evaluated the guards"
    g.after_step(3, _graphs())
    assert _graphs() == compiled
    with g.around(4):  # the check step evaluates them: Dynamo recompiles for 3.0
        assert torch.equal(f(x), 3 * x)
    with pytest.raises(GuardsChanged, match="step 4.*1 steps since the last check"):
        g.after_step(4, _graphs())


def test_full_mode_evaluates_every_guard():
    torch._dynamo.reset()
    m = _Scaled()
    f = torch.compile(m, backend="eager")
    g = SteadyGuards("full", start=0, warmup=2, check_every=4)
    for step in range(1, 6):
        m.factor = float(step)
        with g.around(step):
            assert torch.equal(f(torch.ones(2)), torch.full((2,), float(step)))
