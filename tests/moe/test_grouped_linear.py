"""GroupedLinear equals a loop of hd.Linear per expert, bitwise, for every named recipe.

Splits are uneven, include a zero-token expert and are not multiples of any block
(MXFP8 32, NVFP4 16, FP8 128x1), so every recipe exercises the per-expert padding.
NVFP4 stochastic rounding: both sides hold one SR generator per expert, each seeded with
the quantizer's ``seed`` (GroupedLinear's per-expert states and each hd.Linear's own
state), and both draw for the same padded shapes in the same order, so the draws match
and the recipes are compared unchanged.
"""

import pytest
import torch

import hybrid_dist as hd
from hybrid_dist.moe import GroupedLinear
from tests._helpers import assert_bitwise_equal
from tests.moe._reference import LinearLoop

E, K, N = 4, 128, 128  # 128: FP8 128x128 weight blocks
SPLITS = [37, 0, 90, 73]


def run_both(recipe_name: str, *, quantized_init: bool, steps: int = 2, device: str = "cpu", check=None):
    """GroupedLinear vs the hd.Linear loop; ``check(a, b, what)`` defaults to bitwise."""
    check = check or assert_bitwise_equal
    recipe = hd.recipe_from_name(recipe_name)
    torch.manual_seed(0)
    if quantized_init:
        with hd.quantized_model_init(recipe):
            g = GroupedLinear(E, K, N, recipe=recipe, dtype=torch.bfloat16, device=device)
    else:
        g = GroupedLinear(E, K, N, recipe=recipe, dtype=torch.bfloat16, device=device)
    loop = LinearLoop(g.weight, recipe)
    tpe = torch.tensor(SPLITS, device=device)
    for step in range(steps):
        x = torch.randn(sum(SPLITS), K, dtype=torch.bfloat16, device=device) * (step + 1)
        dy = torch.randn(sum(SPLITS), N, dtype=torch.bfloat16, device=device)
        xg = x.clone().requires_grad_(True)
        y = g(xg, tpe)
        y.backward(dy)
        y_ref, dx_ref, dw_ref = loop.run(x, SPLITS, dy)
        what = f"{recipe_name} quantized_init={quantized_init} step={step} device={device}"
        check(y, y_ref, f"{what} y")
        check(xg.grad, dx_ref, f"{what} dx")
        check(g.weight.grad, dw_ref, f"{what} dW")
        assert torch.count_nonzero(g.weight.grad[1]) == 0, f"{what}: zero-token expert got a gradient"
        g.weight.grad = None


@pytest.mark.parametrize("recipe_name", hd.RECIPE_NAMES)
def test_matches_linear_loop(recipe_name):
    run_both(recipe_name, quantized_init=False)


@pytest.mark.parametrize("recipe_name", hd.RECIPE_NAMES)
def test_matches_linear_loop_quantized_init(recipe_name):
    run_both(recipe_name, quantized_init=True, steps=1)


def test_high_precision_without_recipe():
    torch.manual_seed(0)
    g = GroupedLinear(E, 32, 16)
    x = torch.randn(sum(SPLITS), 32, requires_grad=True)
    y = g(x, torch.tensor(SPLITS))
    ref = torch.cat([xe @ g.weight[i].t() for i, xe in enumerate(torch.split(x, SPLITS))])
    assert_bitwise_equal(y, ref, "no-recipe fprop")


def test_all_tokens_on_one_expert_and_no_tokens():
    g = GroupedLinear(E, K, N, recipe=hd.recipe_from_name("mxfp8"))
    for splits in ([0, 0, 50, 0], [0, 0, 0, 0]):
        x = torch.randn(sum(splits), K, requires_grad=True)
        y = g(x, torch.tensor(splits))
        y.sum().backward()
        assert y.shape == (sum(splits), N) and x.grad.shape == x.shape
        assert g.weight.grad.shape == (E, N, K)
        g.weight.grad = None


def test_bad_input_errors():
    g = GroupedLinear(E, K, N)
    with pytest.raises(ValueError, match="tokens_per_expert"):
        g(torch.randn(4, K), torch.tensor([1.0, 1, 1, 1]))
    with pytest.raises(ValueError, match=r"x \[T, 128\]"):
        g(torch.randn(4, 3), torch.tensor([1, 1, 1, 1]))
    with pytest.raises(NotImplementedError, match="bias"):
        GroupedLinear(E, K, N, bias=True)


@pytest.mark.parametrize("recipe_name", ["fp8_delayed", "nvfp4"])
def test_activation_recompute_is_bitwise(recipe_name):
    """torch.utils.checkpoint reruns the forward in backward: same outputs and gradients
    (delayed-scaling states are not advanced twice, amax recording is idempotent)."""
    from torch.utils.checkpoint import checkpoint

    recipe = hd.recipe_from_name(recipe_name)
    tpe = torch.tensor(SPLITS)
    grads = []
    for recompute in (False, True):
        torch.manual_seed(0)
        g = GroupedLinear(E, K, N, recipe=recipe)
        for step in range(2):
            torch.manual_seed(10 + step)
            x = torch.randn(sum(SPLITS), K, requires_grad=True)
            y = checkpoint(g, x, tpe, use_reentrant=False) if recompute else g(x, tpe)
            y.backward(torch.randn_like(y))
        grads.append((y.detach(), x.grad, g.weight.grad))
    for what, a, b in zip(("y", "dx", "dW"), *grads):
        assert_bitwise_equal(a, b, f"{recipe_name} recompute {what}")


def test_grouped_mm_path_on_cpu_matches_loop():
    """The ``torch._grouped_mm`` autograd path (used on CUDA) run on CPU where torch has a
    CPU kernel: fprop, dgrad and wgrad (zero-token group included) equal a loop of bf16
    matmuls bitwise."""
    from hybrid_dist.moe._grouped_mm import grouped_mm_linear

    torch.manual_seed(0)
    x = torch.randn(sum(SPLITS), 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(E, 32, 64, dtype=torch.bfloat16, requires_grad=True)
    try:
        y = grouped_mm_linear(x, w, torch.tensor(SPLITS))
    except (RuntimeError, NotImplementedError) as err:  # older torch: CUDA only
        pytest.skip(f"torch._grouped_mm has no CPU kernel here: {err}")
    dy = torch.randn_like(y)
    y.backward(dy)
    xr, wr = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    yr = torch.cat([xe @ wr[i].t() for i, xe in enumerate(torch.split(xr, SPLITS))])
    yr.backward(dy)
    for what, a, b in (("y", y, yr), ("dx", x.grad, xr.grad), ("dW", w.grad, wr.grad)):
        assert_bitwise_equal(a, b, f"grouped_mm CPU {what}")


def test_token_counts_must_cover_x():
    import hybrid_dist as hd
    from hybrid_dist.moe import GroupedLinear

    layer = GroupedLinear(2, 64, 32, recipe=hd.recipe_from_name("bf16"))
    x = torch.randn(10, 64)
    for bad in ([4, 4], [12, -2]):
        with pytest.raises(RuntimeError, match="sum to the 10 rows"):
            layer(x, torch.tensor(bad))


def test_grouped_linear_state_dict_carries_per_expert_delayed_histories():
    """``fp8_delayed``: every expert's amax history and scale travel in the state dict
    (``_extra_state``, through ``torch.save`` / ``weights_only=True``); the loaded module's
    next step is bitwise the saved one's."""
    import io

    recipe = hd.recipe_from_name("fp8_delayed")
    torch.manual_seed(0)
    layer = GroupedLinear(3, 64, 32, recipe=recipe)
    tokens = torch.tensor([40, 0, 24])
    for step in range(3):  # different inputs: the histories differ per expert and per slot
        x = torch.randn(64, 64) * (step + 1)
        layer(x, tokens).square().sum().backward()
    sd = layer.state_dict()
    assert "_extra_state" in sd and len(sd["_extra_state"][recipe.name]["input"]) == 3
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    other = GroupedLinear(3, 64, 32, recipe=recipe)
    other.load_state_dict(torch.load(buf, weights_only=True))
    x = torch.randn(64, 64)
    y_next, y_loaded = layer(x, tokens), other(x, tokens)
    assert torch.equal(y_loaded, y_next), "fp8_delayed GroupedLinear: output after a state_dict round trip"
    fresh = GroupedLinear(3, 64, 32, recipe=recipe)
    fresh.load_state_dict({"weight": sd["weight"]})
    assert not torch.equal(fresh(x, tokens), y_next), "the histories must matter for this check to mean anything"


def _stack_every_delayed_state(layer):
    """Point each plan's per-expert delayed states at rows of one stack, as the CUDA path
    does (``formats.float8.stacked_delayed_states``); returns the stacks."""
    from hybrid_dist.formats.float8 import DelayedScalingState, stacked_delayed_states

    stacks = []
    for plan in layer._plans.values():
        for states in plan.states.values():
            if states and all(isinstance(s, DelayedScalingState) for s in states):
                stacks.append(stacked_delayed_states(states, "cpu"))
    assert stacks, "fp8_delayed must keep per-expert delayed states"
    return stacks


def test_grouped_linear_dcp_round_trip_with_stacked_delayed_states(tmp_path):
    """``torch.distributed.checkpoint`` saves per-expert delayed states that are rows of one
    stack (views into shared storage, as on CUDA) and loads them in place into another
    layer's stacked views: the loaded values are the saved ones, the views still point into
    the loading layer's stacks, and its next step is bitwise the saved layer's."""
    import torch.distributed.checkpoint as dcp

    recipe = hd.recipe_from_name("fp8_delayed")
    tokens = torch.tensor([40, 0, 24])
    torch.manual_seed(0)
    layer, other = GroupedLinear(3, 64, 32, recipe=recipe), GroupedLinear(3, 64, 32, recipe=recipe)
    for step in range(3):
        x = torch.randn(64, 64) * (step + 1)
        layer(x, tokens).square().sum().backward()
        if step == 0:
            other(x * 7, tokens).square().sum().backward()  # builds its plan, with other values
    saved_stacks = [(h.clone(), s.clone()) for h, s in _stack_every_delayed_state(layer)]
    dcp.save(layer.state_dict(), checkpoint_id=str(tmp_path))
    other_stacks = _stack_every_delayed_state(other)
    assert not all(torch.equal(h, h1) for (h, _), (h1, _) in zip(other_stacks, saved_stacks)), \
        "the loading layer must start from other histories for this check to mean anything"
    sd = other.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path))
    other.load_state_dict(sd)
    after = _stack_every_delayed_state(other)
    for i, ((h, s), (h0, s0), (h1, s1)) in enumerate(zip(after, other_stacks, saved_stacks)):
        assert h is h0 and s is s0, f"stack {i}: loading replaced the stacked views"
        assert torch.equal(h, h1) and torch.equal(s, s1), f"stack {i}: loaded histories/scales differ from the saved"
    x = torch.randn(64, 64)
    assert torch.equal(other(x, tokens), layer(x, tokens)), \
        "fp8_delayed GroupedLinear: next step after a DCP round trip"
