"""``launch.guards.nonfinite_amaxes`` names the delayed-scaling slots whose amax history
holds a NaN or inf: an inf input to an ``fp8_delayed`` layer shows there (its output stays
finite: the last finite scale is kept), a finite one does not, and hybrid or per-expert
states are searched too; ``first_nonfinite`` names the first parameter in module order whose
value (the fp32 master of a quantized one) or gradient is not finite; and one job at a time
writes a ``--metrics`` file."""

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


def test_first_nonfinite_walks_the_model_in_module_order():
    """The first parameter in module order whose value or gradient is non-finite is named
    (with how many are); None when all are finite."""
    from hybrid_dist.launch.guards import first_nonfinite

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    model(torch.randn(4, 8)).sum().backward()
    assert first_nonfinite(model) is None
    with torch.no_grad():
        model[2].weight[1, 1] = float("inf")
    model[1].bias.grad[0] = float("nan")
    assert first_nonfinite(model) == "1.bias grad (2 of 6 parameters)", first_nonfinite(model)
    with torch.no_grad():
        model[1].bias[3] = float("-inf")
    assert first_nonfinite(model) == "1.bias value and grad (2 of 6 parameters)", first_nonfinite(model)
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    assert first_nonfinite(model) == "0.weight value (3 of 6 parameters)", first_nonfinite(model)


def test_first_nonfinite_checks_the_masters_of_quantized_parameters():
    """Quantized parameters (``quantized_model_init``) are requantized from their fp32
    masters in ``MasterWeightOptimizer``: a NaN master is named although the quantized
    values stay finite."""
    from hybrid_dist.launch.guards import first_nonfinite

    torch.manual_seed(0)
    with hd.quantized_model_init(hd.recipe_from_name("fp8_current")):
        model = nn.Sequential(hd.Linear(32, 32, bias=False), hd.Linear(32, 32, bias=False))
    assert all(isinstance(p, hd.QuantizedTensor) for p in model.parameters())
    opt = hd.MasterWeightOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-3)
    assert first_nonfinite(model, opt) is None
    with torch.no_grad():
        opt.master_of(model[1].weight)[2, 3] = float("nan")
    assert first_nonfinite(model) is None  # the quantized values are unchanged
    assert first_nonfinite(model, opt) == "1.weight value (1 of 2 parameters)", first_nonfinite(model, opt)
