"""``HybridGroupedExperts``: torchtitan's MoE experts converted by ``HybridLinearConverter``
(tiny Qwen3 MoE, CPU). The converted experts are bitwise three ``moe.GroupedLinear``s with
torchtitan's SwiGLU between them on the same bf16 weights, within a stated SQNR of
torchtitan's bf16 experts; parameters and state-dict keys are torchtitan's; a model trains;
recipes that cannot serve the expert shapes leave them unconverted with one warning; the
experts compile with ``aot_eager`` as one graph (slow tier). Skipped without torchtitan."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e \".[torchtitan]\")")

import hybrid_dist as hd  # noqa: E402
from hybrid_dist.integrations.torchtitan import HybridGroupedExperts, HybridLinearConverter  # noqa: E402
from hybrid_dist.moe import GroupedLinear  # noqa: E402
from tests._helpers import assert_bitwise_equal, sqnr_db  # noqa: E402
from tests._tiers import slow  # noqa: E402
from tests.integrations import _titan_moe as tm  # noqa: E402

RECIPES = ["bf16", "fp8_current", "fp8_delayed", "mxfp8", "nvfp4", "mxfp8_fwd_nvfp4_bwd"]
# forward output, input gradient, weight gradients of the converted experts against
# torchtitan's bf16 experts on the same weights: at least this many dB. Measured on this
# fixed input (output, dx, dw1, dw2, dw3): bf16 inf/55/113/inf/131 (fp32 sums in another
# order), fp8_current 24/21/21/22/21, fp8_delayed (first step) 21/19/20/21/19, mxfp8 24/24/
# 24/24/24, nvfp4 12/11/11/12/11, mxfp8_fwd_nvfp4_bwd 24/12/13/15/12 (three GEMMs and a SwiGLU).
MIN_SQNR_DB = {"bf16": 50.0, "fp8_current": 19.0, "fp8_delayed": 18.0, "mxfp8": 22.0, "nvfp4": 10.0,
               "mxfp8_fwd_nvfp4_bwd": 11.0}
TOKENS_PER_EXPERT = [5, 0, 19, 40]  # an empty expert; none a block multiple


def _converter(recipe: str, **kw):
    kw.setdefault("filter_fqns", ["router.gate"])  # out_features = 4 experts: no block multiple
    return HybridLinearConverter.Config(recipe=recipe, **kw).build()


def _model(recipe: str | None, **kw):
    cfg = tm.config() if recipe is None else _converter(recipe, **kw).convert(tm.config())
    return tm.build(cfg, meta=True)


def _experts_call(fn, w1, w2, w3, seed: int = 3):
    """Output and gradients (x, w1, w2, w3) of ``fn(x, counts)`` on a fixed fp32 input."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor(TOKENS_PER_EXPERT)
    x = torch.randn(int(counts.sum()), tm.DIM, generator=g).requires_grad_()
    dy = torch.randn(int(counts.sum()), tm.DIM, generator=g)
    y = fn(x, counts)
    y.backward(dy)
    return [y.detach(), x.grad, w1.grad, w2.grad, w3.grad]


def _grouped_linear_reference(experts, recipe: hd.Recipe):
    """``experts``' computation written with three ``moe.GroupedLinear`` on its weights in bf16."""
    gls = {}
    for w in ("w1_EFD", "w2_EDF", "w3_EFD"):
        p = getattr(experts, w)
        gls[w] = GroupedLinear(p.shape[0], p.shape[2], p.shape[1], recipe=recipe, name=f"{experts.name}.{w}")
        gls[w].weight = torch.nn.Parameter(p.detach().bfloat16())

    def fn(x, counts):
        xb = x.bfloat16()
        h = F.silu(gls["w1_EFD"](xb, counts)) * gls["w3_EFD"](xb, counts)
        return gls["w2_EDF"](h, counts).float()
    return fn, [gls[w].weight for w in ("w1_EFD", "w2_EDF", "w3_EFD")]


def test_converter_swaps_experts_by_configuration_through_model_registry():
    from torchtitan.models.common.moe import GroupedExperts
    from torchtitan.models.qwen3 import model_registry

    for convert_experts, want in ((True, 8), (False, 0)):
        spec = model_registry("debugmodel_moe", converters=[HybridLinearConverter.Config(
            recipe="mxfp8", filter_fqns=["router.gate"], convert_experts=convert_experts)])
        with torch.device("meta"):
            model = spec.model.build()
        experts = {n: m for n, m in model.named_modules() if isinstance(m, GroupedExperts)}
        hybrid = {n: m for n, m in experts.items() if isinstance(m, HybridGroupedExperts)}
        assert len(experts) == 8 and len(hybrid) == want, (convert_experts, sorted(hybrid))
        for n, m in hybrid.items():
            roles = [p.weight for p in m.plan_for(m.recipe).gemms.values()]
            assert m.name == n and m.recipe.name == "mxfp8" and len(roles) == 3


@pytest.mark.parametrize("recipe", RECIPES)
def test_experts_are_bitwise_grouped_linear_and_near_bf16(recipe):
    from torchtitan.models.common.moe import GroupedExperts

    model = _model(recipe)
    experts = model.layers["0"].moe.routed_experts.inner_experts
    assert type(experts) is HybridGroupedExperts and experts.name == tm.EXPERTS_FQNS[0]
    weights = [experts.w1_EFD, experts.w2_EDF, experts.w3_EFD]
    got = _experts_call(experts, *weights)

    ref_fn, ref_weights = _grouped_linear_reference(experts, experts.recipe)
    want = _experts_call(ref_fn, *ref_weights)
    names = ["output", "x grad", "w1 grad", "w2 grad", "w3 grad"]
    for name, g, w in zip(names, got, want):
        assert_bitwise_equal(g, w.float(), f"{recipe}: {name} vs GroupedLinear")

    plain = GroupedExperts(GroupedExperts.Config(dim=tm.DIM, hidden_dim=tm.HIDDEN, num_experts=tm.EXPERTS))
    plain.load_state_dict(experts.state_dict(), strict=False)  # keys equal; _extra_state (SR) is not torchtitan's
    bf16 = _experts_call(plain, plain.w1_EFD, plain.w2_EDF, plain.w3_EFD)
    for name, g, b in zip(names, got, bf16):
        assert sqnr_db(b, g) >= MIN_SQNR_DB[recipe], f"{recipe}: {name} SQNR {sqnr_db(b, g):.1f} dB vs bf16 experts"


@pytest.mark.parametrize("recipe", ["fp8_current", "mxfp8_fwd_nvfp4_bwd"])
def test_converted_model_trains_with_torchtitans_state_dict_keys(recipe):
    model, plain = _model(recipe), _model(None)
    assert sum(isinstance(m, HybridGroupedExperts) for m in model.modules()) == tm.LAYERS
    keys, plain_keys = set(model.state_dict()), set(plain.state_dict())
    assert {k for k in keys if not k.endswith("._extra_state")} == plain_keys, sorted(keys ^ plain_keys)
    if recipe == "fp8_current":  # no quantizer state: the keys are torchtitan's
        assert keys == plain_keys
    model.load_state_dict(plain.state_dict())  # a torchtitan checkpoint loads as it is
    for (n, p), q in zip(plain.named_parameters(), model.parameters()):
        assert_bitwise_equal(q.detach(), p.detach(), f"{recipe}: {n} after load")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens, losses = tm.batches(1)[0], []
    for step in range(5):
        loss = tm.loss_fn(model, tokens)
        loss.backward()
        if step == 0:
            for n, p in model.named_parameters():
                if "inner_experts" in n:
                    assert p.grad is not None and p.grad.abs().sum() > 0, f"{recipe}: no gradient for {n}"
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 0.5, losses


def test_delayed_scaling_states_round_trip_the_state_dict():
    model = _model("fp8_delayed")
    tokens = tm.batches(2)
    for t in tokens:
        tm.loss_fn(model, t).backward()
    sd = model.state_dict()
    extra = sd[f"{tm.EXPERTS_FQNS[0]}._extra_state"]["fp8_delayed"]
    assert sorted(extra) == sorted(f"{w}.{t}" for w in ("w1_EFD", "w2_EDF", "w3_EFD")
                                   for t in ("input", "weight", "grad_output")), sorted(extra)
    fresh = _model("fp8_delayed")
    fresh.load_state_dict(sd)
    with torch.no_grad():
        assert_bitwise_equal(tm.loss_fn(fresh, tokens[0]), tm.loss_fn(model, tokens[0]), "loss after load")


def test_unservable_recipe_leaves_experts_with_one_warning():
    """fp8_block's 128x128 weight blocks do not divide D = F = 64: the experts stay
    torchtitan's (Linears left out with ``fqns``), bitwise the unconverted model."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = _converter("fp8_block", fqns=["inner_experts"]).convert(tm.config())
    msgs = [str(w.message) for w in caught if "MoE experts" in str(w.message)]
    assert len(msgs) == 1 and tm.EXPERTS_FQNS[0] in msgs[0] and "and 1 more" in msgs[0], msgs
    assert "Float8BlockQuantizer" in msgs[0] and "fp8_block" in msgs[0], msgs[0]
    model, plain = tm.build(cfg, meta=True), _model(None)
    assert not any(isinstance(m, HybridGroupedExperts) for m in model.modules())
    tokens = tm.batches(1)[0]
    assert_bitwise_equal(tm.loss_fn(model, tokens), tm.loss_fn(plain, tokens), "loss, experts unconverted")


def test_experts_subclass_with_its_own_forward_is_left_with_a_warning():
    from dataclasses import dataclass

    from torchtitan.models.common.moe import GroupedExperts

    class OwnExperts(GroupedExperts):
        @dataclass(kw_only=True, slots=True)
        class Config(GroupedExperts.Config):
            pass

    cfg = tm.config(layers=1)
    inner = cfg.layers[0].moe.routed_experts.inner_experts
    cfg.layers[0].moe.routed_experts.inner_experts = OwnExperts.Config(
        dim=inner.dim, hidden_dim=inner.hidden_dim, num_experts=inner.num_experts, param_init=inner.param_init)
    with pytest.warns(UserWarning, match="OwnExperts.Config is not GroupedExperts.Config"):
        cfg = _converter("mxfp8").convert(cfg)
    assert type(cfg.layers[0].moe.routed_experts.inner_experts) is OwnExperts.Config


@slow
def test_experts_compile_as_one_graph_bitwise_eager():
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager = _model("mxfp8_fwd_nvfp4_bwd").layers["0"].moe.routed_experts.inner_experts
    compiled = _model("mxfp8_fwd_nvfp4_bwd").layers["0"].moe.routed_experts.inner_experts
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(compiled, backend=counter, fullgraph=True)
    for step in range(2):
        want = _experts_call(eager, eager.w1_EFD, eager.w2_EDF, eager.w3_EFD, seed=step)
        got = _experts_call(fn, compiled.w1_EFD, compiled.w2_EDF, compiled.w3_EFD, seed=step)
        for name, g, w in zip(["output", "x grad", "w1 grad", "w2 grad", "w3 grad"], got, want):
            assert_bitwise_equal(g, w, f"step {step}: {name} (compiled vs eager)")
        for p in (*eager.parameters(), *compiled.parameters()):
            p.grad = None
    assert counter.frame_count == 1 and sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


def test_fewer_local_experts_or_no_recipe_run_torchtitans_forward():
    """Expert parallelism leaves a rank fewer experts than the config: torchtitan's bf16
    forward, warned once; without a recipe (``hd.set_recipe(model, None)``) likewise."""
    from torchtitan.models.common.moe import GroupedExperts

    experts = _model("mxfp8").layers["0"].moe.routed_experts.inner_experts
    plain = GroupedExperts(GroupedExperts.Config(dim=tm.DIM, hidden_dim=tm.HIDDEN, num_experts=tm.EXPERTS))
    plain.load_state_dict(experts.state_dict())
    x, counts = torch.randn(24, tm.DIM, generator=torch.Generator().manual_seed(5)), torch.tensor([10, 14])
    for m in (experts, plain):  # the first two experts, as one of two EP ranks holds them
        for w in ("w1_EFD", "w2_EDF", "w3_EFD"):
            setattr(m, w, torch.nn.Parameter(getattr(m, w).detach()[:2]))
    with pytest.warns(UserWarning, match="2 local experts of 4"):
        assert_bitwise_equal(experts(x, counts), plain(x, counts), "2 local experts")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        experts(x, counts)
    hd.set_recipe(experts, None)
    assert_bitwise_equal(experts(x, counts), plain(x, counts), "no recipe")
