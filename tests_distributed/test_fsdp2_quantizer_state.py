"""Quantizer states in ``hd.Linear``'s state dict (single process; the DCP resharding
round trip is in ``test_fsdp2_dcp``).

A module whose plan keeps a ``DelayedScalingState`` writes ``_extra_state`` =
``{recipe name: {tensor_type: {"amax_history", "scale"}}}``, one with stochastic rounding
(``NVFP4State``) ``{..., {"kernel_key", "generator_<device type>"}}``; modules without
either keep their state dict keys unchanged. Loading restores the states bitwise, also into
a module that has not built the recipe's plan yet (applied when it is built), and a resumed
module then computes bitwise the same outputs (and, with stochastic rounding, gradients) as
the uninterrupted one.
"""

from __future__ import annotations

import io

import pytest
import torch

import hybrid_dist as hd
from hybrid_dist.recipe_module import QUANTIZER_STATE_KEY


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


def _grads(lin, recipe, xs, *, autocast: bool):
    """The weight gradient of each step (stochastic rounding acts in backward only)."""
    out = []
    for x in xs:
        lin.zero_grad()
        _run(lin, recipe, [x], autocast=autocast)
        out.append(lin.weight.grad.clone())
    return out


def _round_trip(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("autocast", [False, True], ids=["module_recipe", "autocast_recipe"])
def test_stochastic_rounding_streams_resume_bitwise(autocast):
    recipe = hd.recipe_from_name("mxfp8_fwd_nvfp4_bwd")  # grad_output: one NVFP4 SR quantizer
    torch.manual_seed(0)
    a = hd.Linear(32, 16, recipe=None if autocast else recipe)
    xs = _batches(5)
    _grads(a, recipe, xs[:3], autocast=autocast)
    sd = _round_trip(a.state_dict())
    saved = sd[QUANTIZER_STATE_KEY]["mxfp8_fwd_nvfp4_bwd"]["grad_output"]
    assert set(saved) == {"kernel_key", "generator_cpu"}, saved
    b = hd.Linear(32, 16, recipe=None if autocast else recipe)  # a plan only under its own recipe
    b.load_state_dict(sd)
    c = hd.Linear(32, 16, recipe=None if autocast else recipe)  # the weights only: SR restarts
    c.load_state_dict({k: v for k, v in sd.items() if k != QUANTIZER_STATE_KEY})
    ga, gb, gc = (_grads(m, recipe, xs[3:], autocast=autocast) for m in (a, b, c))
    for step, (u, v, w) in enumerate(zip(ga, gb, gc)):
        assert torch.equal(u, v), f"autocast={autocast}: weight gradient of step {step} after resume differs"
        assert not torch.equal(u, w), f"autocast={autocast}: step {step} is the same without the SR state"


def test_sr_state_loaded_before_its_device_exists_seeds_it():
    """A key or generator made after the load (the module moved to another device since)
    starts where the checkpoint stood, not at the seed."""
    from hybrid_dist.formats.nvfp4 import NVFP4State, first_kernel_key

    src = NVFP4State(seed=3)
    src.advance_kernel_key("cpu")
    first = torch.rand(4, generator=src.generator("cpu"))
    dst = NVFP4State(seed=3)  # no key or generator yet
    dst.load_state_dict(_round_trip(src.state_dict("cpu")))
    assert int(dst.kernel_key("cpu")) == first_kernel_key(3) + 1
    nxt = torch.rand(4, generator=dst.generator("cpu"))
    assert torch.equal(nxt, torch.rand(4, generator=src.generator("cpu"))) and not torch.equal(nxt, first)


def test_bad_sr_state_entries_are_value_errors():
    from hybrid_dist.formats.nvfp4 import NVFP4State

    with pytest.raises(ValueError, match=r"unknown entries \['generator'\]"):
        NVFP4State(seed=0).load_state_dict({"kernel_key": torch.zeros(1, dtype=torch.int64),
                                            "generator": torch.zeros(16, dtype=torch.uint8)})
    recipe = hd.recipe_from_name("nvfp4")
    sd = hd.Linear(32, 16, recipe=recipe).state_dict()
    del sd[QUANTIZER_STATE_KEY]  # a state for a tensor type whose quantizer keeps none:
    sd[QUANTIZER_STATE_KEY] = {"nvfp4": {"input": {"kernel_key": torch.zeros(1, dtype=torch.int64)}}}
    with pytest.raises(ValueError, match="nvfp4.input.kernel_key.*keeps none there"):
        hd.Linear(32, 16, recipe=recipe).load_state_dict(sd)
