"""Delayed-scaling states in ``hd.Linear``'s state dict (single process; the DCP resharding
round trip is in ``test_fsdp2_dcp``).

A module whose plan keeps a ``DelayedScalingState`` writes ``_extra_state`` =
``{recipe name: {tensor_type: {"amax_history", "scale"}}}``; modules without one keep
their state dict keys unchanged. Loading restores the histories bitwise, also into a
module that has not built the recipe's plan yet (applied when it is built), and a
resumed module then computes bitwise the same outputs as the uninterrupted one.
"""

from __future__ import annotations

import io

import pytest
import torch

import hybrid_dist as hd
from hybrid_dist._recipe_module import QUANTIZER_STATE_KEY


def _run(lin, recipe, xs, *, autocast: bool):
    out = []
    for x in xs:
        with hd.autocast(recipe) if autocast else torch.autocast("cpu", enabled=False):
            y = lin(x.requires_grad_())
        y.square().sum().backward()
        out.append(y.detach())
    return out


def _batches(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(32, 32, generator=gen) * (1 + i) for i in range(n)]


@pytest.mark.parametrize("autocast", [False, True], ids=["module_recipe", "autocast_recipe"])
def test_delayed_histories_round_trip_through_torch_save(autocast):
    recipe = hd.recipe_from_name("fp8_delayed")
    torch.manual_seed(0)
    a = hd.Linear(32, 16, recipe=None if autocast else recipe)
    xs = _batches(5)
    _run(a, recipe, xs[:3], autocast=autocast)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert set(sd[QUANTIZER_STATE_KEY]["fp8_delayed"]) == {"input", "weight", "grad_output"}
    torch.manual_seed(1)
    b = hd.Linear(32, 16, recipe=None if autocast else recipe)  # other weights, no plan under autocast
    b.load_state_dict(sd)
    ya, yb = _run(a, recipe, xs[3:], autocast=autocast), _run(b, recipe, xs[3:], autocast=autocast)
    for step, (u, v) in enumerate(zip(ya, yb)):
        assert torch.equal(u, v), f"autocast={autocast}: step {step} after resume differs"
    for t, s in a.quantizer_state_dict()["fp8_delayed"].items():
        for f, v in s.items():
            assert torch.equal(v, b.quantizer_state_dict()["fp8_delayed"][t][f]), f"{t}.{f}"


def test_no_delayed_state_keeps_the_state_dict_keys():
    lin = hd.Linear(32, 32, recipe=hd.recipe_from_name("mxfp8"))
    _run(lin, lin.recipe, _batches(1), autocast=False)
    assert sorted(lin.state_dict()) == ["bias", "weight"]
    lin.load_state_dict(torch.nn.Linear(32, 32).state_dict())  # strict, as before


def test_history_length_mismatch_is_a_value_error():
    short = hd.CustomRecipe(lambda role: hd.Float8Quantizer(scaling="delayed", amax_history_len=4), name="d")
    long = hd.CustomRecipe(lambda role: hd.Float8Quantizer(scaling="delayed", amax_history_len=8), name="d")
    sd = hd.Linear(32, 16, recipe=short).state_dict()
    with pytest.raises(ValueError, match="amax_history_len"):
        hd.Linear(32, 16, recipe=long).load_state_dict(sd)
