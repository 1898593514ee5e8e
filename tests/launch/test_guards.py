"""``launch.guards.nonfinite_amaxes`` names the delayed-scaling slots whose amax history
holds a NaN or inf: an inf input to an ``fp8_delayed`` layer shows there (its output stays
finite: the last finite scale is kept), a finite one does not, and hybrid or per-expert
states are searched too; and one job at a time writes a ``--metrics`` file."""

from __future__ import annotations

import torch
from torch import nn

import hybrid_dist as hd
from hybrid_dist.launch.guards import nonfinite_amaxes


def test_inf_input_to_delayed_scaling_is_reported():
    recipe = hd.recipe_from_name("fp8_delayed")
    model = nn.Sequential(hd.Linear(32, 32, bias=False), hd.Linear(32, 32, bias=False))
    hd.set_recipe(model, recipe)
    x = torch.randn(16, 32)
    model(x).sum().backward()
    assert nonfinite_amaxes(model) == []
    x_bad = x.clone()
    x_bad[3, 5] = float("inf")
    y = model[1](model[0](x).detach())  # layer 1 sees a finite input
    model[0](x_bad)
    assert torch.isfinite(y).all()
    assert nonfinite_amaxes(model) == ["0/input"], nonfinite_amaxes(model)


def test_grouped_and_hybrid_states_are_searched():
    from hybrid_dist.moe import GroupedLinear

    grouped = GroupedLinear(2, 32, 32, recipe=hd.recipe_from_name("fp8_delayed"), name="experts")
    plan = grouped.plan(grouped.recipe)
    plan.states["grad_output"][1].amax_history[0] = float("nan")
    assert nonfinite_amaxes(nn.ModuleDict({"experts": grouped})) == ["experts/grad_output[1]"]


def test_metrics_file_has_one_writer(tmp_path):
    """A second job given the same ``--metrics`` path is refused while the first writes it."""
    import pytest

    from hybrid_dist.launch.metrics import Meter

    def meter():
        return Meter(total_steps=2, flops_per_token=1, world_size=1, device=torch.device("cpu"), rank=0,
                     jsonl_path=str(tmp_path / "m.jsonl"), log_every=1, quiet=True, run={}, ag_bytes_per_step=None,
                     ag_measured=False, timing_warmup=0)

    first = meter()
    with pytest.raises(ValueError, match="another job is writing this file"):
        meter()
    first.step(1, 1.0, 10, 1e-3)
    first.finish({})
    meter().finish({})  # free again once the first has finished
