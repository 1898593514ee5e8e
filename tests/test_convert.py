"""``hd.convert_to_hybrid`` and ``hd.set_recipe`` build each module's plan at once, so a
model converted and then compiled traces whole, stochastic-rounding recipes included (one
graph, no graph break, bitwise eager on CPU); ``set_recipe`` reaches every recipe-aware
module (``hd.Linear``, ``moe.GroupedLinear``, ``moe.MoE``) and names it by its path; a
shape that does not fit a block names the layer in its error."""

from __future__ import annotations

import torch
from torch import nn

import hybrid_dist as hd
from tests._helpers import assert_bitwise_equal


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128, bias=False), nn.GELU(), nn.Linear(128, 64, bias=False)).to(torch.bfloat16)


def test_compile_right_after_conversion_is_one_graph_sr_recipe():
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    recipe = hd.recipe_from_name("mxfp8_fwd_nvfp4_bwd")  # NVFP4 gradients with stochastic rounding
    eager, compiled = hd.convert_to_hybrid(_mlp(), recipe=recipe), hd.convert_to_hybrid(_mlp(), recipe=recipe)
    assert all(m._plans for m in compiled.modules() if isinstance(m, hd.Linear)), "plans not built at conversion"
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(compiled, backend=counter, fullgraph=True)
    g = torch.Generator().manual_seed(1)
    for step in range(2):
        x = torch.randn(64, 64, generator=g).to(torch.bfloat16)
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        eager(xa).float().sum().backward()
        fn(xb).float().sum().backward()
        assert_bitwise_equal(xb.grad, xa.grad, f"step {step}: dx (compiled vs eager)")
        for (n, a), b in zip(eager.named_parameters(), compiled.parameters()):
            assert_bitwise_equal(b.grad, a.grad, f"step {step}: grad of {n}")
    assert counter.frame_count == 1 and sum(counters["graph_break"].values()) == 0


def test_set_recipe_reaches_every_recipe_aware_module():
    from hybrid_dist.moe import MoE, GroupedLinear

    recipe = hd.recipe_from_name("fp8_delayed")
    model = nn.ModuleDict({"proj": hd.Linear(64, 64, bias=False),
                           "moe": MoE(64, 64, num_experts=2, top_k=1, name="moe")})
    hd.set_recipe(model, recipe)
    aware = [(n, m) for n, m in model.named_modules() if isinstance(m, (hd.Linear, GroupedLinear, MoE))]
    assert len(aware) == 4
    for name, mod in aware:
        assert mod.recipe is recipe, name
        if not isinstance(mod, MoE):
            assert mod.name == name and mod._plans, name
    hd.set_recipe(model, None, module_filter_fn=lambda mod, fqn: fqn == "proj")
    assert model["proj"].recipe is None and model["moe"].recipe is recipe


def test_block_misfit_error_names_the_layer():
    """A shape that does not fit a format's block fails at the first forward with the
    layer's qualified name and the recipe in the message."""
    import pytest

    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 48))
    hd.convert_to_hybrid(model, recipe=hd.recipe_from_name("mxfp8"))
    with pytest.raises(ValueError, match=r"hd.Linear '0' under recipe 'mxfp8': MXFP8Quantizer columnwise: dim M"):
        model(torch.randn(40, 64))
