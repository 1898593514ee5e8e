"""``hd.convert_to_hybrid(model, recipe=..., quantized_weights=True)`` on an existing model.

Each converted weight becomes a QuantizedTensor parameter bitwise equal to the recipe's
weight quantizer applied to the original weight, with the plans built at conversion, and
(by default) keeps the original values in fp32, from which ``MasterWeightOptimizer``
starts its master bitwise. The reference: the same model converted with high-precision
weights and trained by plain AdamW, whose weights are quantized each step. For a recipe
whose weight quantizer keeps no state (all but ``fp8_delayed``, whose layers quantize a
high-precision weight with delayed scaling) the quantized-weight model trains bitwise like
it: losses, and masters equal to the reference's fp32 weights. Covered on a local
Llama-shaped model (``tests/_tiny_llama``) and, when ``transformers`` is installed, on its
``LlamaForCausalLM``.
"""

from __future__ import annotations

import pytest
import torch

import hybrid_dist as hd
from hybrid_dist import hp_init
from hybrid_dist.hybrid import stateless
from tests import _tiny_llama as tiny
from tests._helpers import assert_bitwise_equal
from tests._tiers import by_recipe

STATELESS_WEIGHTS = [n for n in hd.RECIPE_NAMES if n != "fp8_delayed"]
FAST = ("fp8_current", "mxfp8_fwd_nvfp4_bwd")


def _linears(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, hd.Linear)]


@pytest.mark.parametrize("name", by_recipe(fast=FAST))
@pytest.mark.parametrize("keep", [True, False], ids=["keep_init", "no_init"])
def test_converted_weights_are_quantized_originals_with_masters(name, keep):
    recipe = hd.recipe_from_name(name)
    ref = tiny.build()
    model = hd.convert_to_hybrid(tiny.build(), recipe=recipe, quantized_weights=True, keep_high_precision_init=keep)
    linears = _linears(model)
    assert len(linears) == tiny.LAYERS * 7 + 1
    originals = dict(ref.named_parameters())
    for fqn, mod in linears:
        w, orig = mod.weight, originals[f"{fqn}.weight"]
        assert isinstance(w, hd.QuantizedTensor) and w.requires_grad, fqn
        assert mod.recipe is recipe and mod.name == fqn and mod._plans, f"{fqn}: plan not built at conversion"
        expect = stateless(mod.plan_for(recipe).weight).quantize(orig.detach(), rowwise=True, columnwise=True)
        for d in ("rowwise", "columnwise"):
            for f, t in w.storage_of(d).tensors().items():
                assert_bitwise_equal(t, getattr(expect.storage_of(d), f), f"{name} {fqn} {d}.{f}")
        init = hp_init.kept(w)
        if keep:
            assert_bitwise_equal(init, orig.detach().float(), f"{fqn}: kept init")
            assert init.untyped_storage().data_ptr() != orig.untyped_storage().data_ptr(), "init aliases the model"
        else:
            assert init is None, fqn
    dequantized = {fqn: mod.weight.dequantize(dtype=torch.float32) for fqn, mod in linears}
    opt = hd.MasterWeightOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-2)
    for fqn, mod in linears:
        want = originals[f"{fqn}.weight"].detach().float() if keep else dequantized[fqn]
        assert_bitwise_equal(opt.master_of(mod.weight), want, f"{name} {fqn}: master")
        assert hp_init.kept(mod.weight) is None, f"{fqn}: init not freed once the master took it"


def _train_pair(make, recipe, batches, loss_fn):
    """Losses of ``make()`` converted with high-precision weights + AdamW, and with
    quantized weights + MasterWeightOptimizer(AdamW); the two models and the optimizer."""
    ref = hd.convert_to_hybrid(make(), recipe=recipe)
    model = hd.convert_to_hybrid(make(), recipe=recipe, quantized_weights=True)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=2e-3)
    opt = hd.MasterWeightOptimizer(torch.optim.AdamW, model.parameters(), lr=2e-3)
    losses = []
    for tokens in batches:
        step = []
        for m, o in ((ref, opt_ref), (model, opt)):
            loss = loss_fn(m, tokens)
            loss.backward()
            o.step()
            o.zero_grad()
            step.append(loss.item())
        losses.append(tuple(step))
    return losses, ref, model, opt


def _check_pair(name, losses, ref, model, opt):
    for step, (l_ref, l_q) in enumerate(losses):
        assert l_ref == l_q, f"{name} step {step}: quantized-weight loss {l_q} != high-precision-weight loss {l_ref}"
    for (fqn, p_ref), p in zip(ref.named_parameters(), model.parameters()):
        assert_bitwise_equal(opt.master_of(p), p_ref.detach().float(), f"{name}: master of {fqn}")
    assert losses[-1][1] < losses[0][1], f"{name}: loss on a repeated batch did not fall {losses}"


@pytest.mark.parametrize("name", by_recipe(STATELESS_WEIGHTS, fast=FAST))
def test_quantized_weights_train_bitwise_like_high_precision_weights(name):
    recipe = hd.recipe_from_name(name)
    losses, ref, model, opt = _train_pair(tiny.build, recipe, tiny.batches(1) * 3, tiny.loss_fn)
    _check_pair(name, losses, ref, model, opt)


def test_tied_weight_stays_high_precision_and_tied():
    model = tiny.build()
    model.lm_head.weight = model.embed.weight
    with pytest.warns(UserWarning, match="lm_head.weight is shared with another module"):
        hd.convert_to_hybrid(model, recipe=hd.recipe_from_name("mxfp8"), quantized_weights=True)
    assert model.lm_head.weight is model.embed.weight and not isinstance(model.embed.weight, hd.QuantizedTensor)
    assert isinstance(model.layers[0].q.weight, hd.QuantizedTensor)


def test_quantized_weights_need_a_recipe():
    with pytest.raises(ValueError, match="quantized_weights=True needs a recipe"):
        hd.convert_to_hybrid(tiny.build(), quantized_weights=True)


def _hf_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=tiny.VOCAB, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                   max_position_embeddings=tiny.SEQ, tie_word_embeddings=False)

    def make():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(cfg)

    return make


def _hf_loss(model, tokens):
    return model(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss


@pytest.mark.parametrize("name", by_recipe(STATELESS_WEIGHTS, fast=FAST))
def test_hf_llama_quantized_weights_train_bitwise_like_high_precision_weights(name):
    make = _hf_llama()
    recipe = hd.recipe_from_name(name)
    losses, ref, model, opt = _train_pair(make, recipe, tiny.batches(1) * 3, _hf_loss)
    linears = _linears(model)
    assert len(linears) == 2 * 7 + 1 and all(isinstance(m.weight, hd.QuantizedTensor) for _, m in linears)
    _check_pair(name, losses, ref, model, opt)


@pytest.mark.parametrize("name", by_recipe(fast=("mxfp8_fwd_nvfp4_bwd",)))
def test_hf_llama_compiles_right_after_conversion_whole_and_bitwise(name):
    """``torch.compile`` (``aot_eager``) of a ``LlamaForCausalLM`` straight after
    ``convert_to_hybrid(..., quantized_weights=True)``: one graph, no break (the plans and
    stochastic-rounding states exist from conversion), and loss and every gradient bitwise
    the same model run eagerly."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    make = _hf_llama()
    recipe = hd.recipe_from_name(name)
    tokens = tiny.batches(1)[0]
    runs = []
    for compiled in (False, True):
        model = make()
        hd.convert_to_hybrid(model, recipe=recipe, quantized_weights=True)
        fn = model
        if compiled:
            torch._dynamo.reset()
            counters.clear()
            backend = CompileCounterWithBackend("aot_eager")
            fn = torch.compile(model, backend=backend)
        loss = _hf_loss(fn, tokens)
        loss.backward()
        runs.append((loss.detach(), [p.grad for p in model.parameters() if p.grad is not None]))
    breaks = sum(counters["graph_break"].values())
    assert breaks == 0 and backend.frame_count == 1, (
        f"{name}: {backend.frame_count} graphs, {breaks} graph breaks: {dict(counters['graph_break'])}")
    (eager_loss, eager_grads), (loss, grads) = runs
    assert_bitwise_equal(loss, eager_loss, f"{name}: compiled loss")
    assert len(grads) == len(eager_grads) > 0
    for i, (g, ref) in enumerate(zip(grads, eager_grads)):
        assert_bitwise_equal(g, ref, f"{name}: gradient {i}")
