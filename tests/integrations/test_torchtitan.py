"""``hybrid_dist.integrations.torchtitan``: the converter on torchtitan's own Llama 3 (tiny,
CPU). Converted by configuration, the model is bitwise the same torchtitan model converted
with ``hd.convert_to_hybrid`` (same init, same losses), with the quantized-all-gather weights
too; it compiles with ``aot_eager`` without a graph break. Skipped without torchtitan."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e \".[torchtitan]\")")

import hybrid_dist as hd  # noqa: E402
from hybrid_dist.fsdp2 import HighPrecisionParam  # noqa: E402
from hybrid_dist.integrations.torchtitan import HybridLinear, HybridLinearConverter  # noqa: E402
from tests._helpers import assert_bitwise_equal  # noqa: E402
from tests._tiers import slow  # noqa: E402
from tests.integrations import _titan_llama as tl  # noqa: E402

STEPS = 4
LINEARS = 1 + 5 * tl.LAYERS  # lm_head + wqkv, wo, w1, w2, w3 per block


def custom_recipe() -> hd.Recipe:
    """MXFP8 everywhere but the feed-forward's w2 (bf16): a custom recipe for ``module:attr``."""
    bf16, mx = hd.recipe_from_name("bf16"), hd.recipe_from_name("mxfp8")
    return hd.CustomRecipe(lambda role: (bf16 if role.name.endswith("feed_forward.w2") else mx).quantizer(role),
                           name="mxfp8_bf16_w2")


def _converted(recipe: str, **kw):
    return tl.build(HybridLinearConverter.Config(recipe=recipe, **kw).build().convert(tl.config()), meta=True)


def _train(model, tokens, steps=STEPS) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = tl.loss_fn(model, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def test_converter_by_configuration_through_model_registry():
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.common.linear import Linear as TitanLinear

    spec = model_registry("debugmodel", converters=[
        HybridLinearConverter.Config(recipe="fp8_current", filter_fqns=["lm_head"])])
    with torch.device("meta"):
        model = spec.model.build()
    hybrid = {n: m for n, m in model.named_modules() if isinstance(m, HybridLinear)}
    assert len(hybrid) == 5 * 6 and "lm_head" not in hybrid, sorted(hybrid)
    assert type(model.lm_head) is TitanLinear
    assert all(m.recipe.name == "fp8_current" and m.name == n and m._plans for n, m in hybrid.items())


@pytest.mark.parametrize("recipe", ["fp8_current", "mxfp8_fwd_nvfp4_bwd",
                                    "tests.integrations.test_torchtitan:custom_recipe"])
def test_converted_by_config_is_bitwise_convert_to_hybrid(recipe):
    loaded = HybridLinearConverter.Config(recipe=recipe).build().recipe
    ref = hd.convert_to_hybrid(tl.build(tl.config()), recipe=loaded)
    model = _converted(recipe)
    assert sum(isinstance(m, HybridLinear) for m in model.modules()) == LINEARS
    for (n, p), q in zip(ref.named_parameters(), model.parameters()):
        assert_bitwise_equal(q.detach(), p.detach(), f"{recipe}: init of {n}")
    tokens = tl.batches(1)[0]
    got, want = _train(model, tokens), _train(ref, tokens)
    for step, (g, w) in enumerate(zip(got, want)):
        assert_bitwise_equal(g, w, f"{recipe}: loss at step {step}")
    assert got[-1] < got[0] - 1.0, [float(x) for x in got]


def test_quantized_all_gather_weights_train_bitwise_like_plain():
    name = "mxfp8_fwd_nvfp4_bwd"
    model, plain = _converted(name, quantized_all_gather=True), _converted(name)
    weights = [m.weight for m in model.modules() if isinstance(m, HybridLinear)]
    assert len(weights) == LINEARS and all(isinstance(w, HighPrecisionParam) for w in weights)
    tokens = tl.batches(1)[0]
    for step, (g, w) in enumerate(zip(_train(model, tokens), _train(plain, tokens))):
        assert_bitwise_equal(g, w, f"loss at step {step}")


def test_bad_recipe_is_a_value_error():
    with pytest.raises(ValueError, match="no_such_recipe"):
        HybridLinearConverter.Config(recipe="no_such_recipe").build()


@slow
def test_compiled_right_after_conversion_is_one_graph():
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager, compiled = _converted("mxfp8_fwd_nvfp4_bwd"), _converted("mxfp8_fwd_nvfp4_bwd")
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(compiled, backend=counter)
    tokens = tl.batches(1)[0]
    for step in range(2):
        tl.loss_fn(eager, tokens).backward()
        tl.loss_fn(fn, tokens).backward()
        for (n, a), b in zip(eager.named_parameters(), compiled.parameters()):
            assert_bitwise_equal(b.grad, a.grad, f"step {step}: grad of {n} (compiled vs eager)")
    assert counter.frame_count == 1 and sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
