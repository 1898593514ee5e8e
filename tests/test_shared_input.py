"""Shared input quantization (hd.RMSNorm / hd.SwiGLU linked to hd.Linear consumers):
bitwise equal to the unfused path for every named recipe, fallbacks, errors, the number
of quantizations, and activation checkpointing."""

from __future__ import annotations

import warnings
from unittest import mock

import pytest
import torch

import hybrid_dist as hd
from tests._helpers import assert_bitwise_equal

RECIPES = list(hd.RECIPE_NAMES)
STATEFUL = {"fp8_delayed"}
# tokens M = 384 (multiple of 128 for FP8-block columnwise), model dim D = 256, ffn F = 256
SHAPE_BSD = (3, 128, 256)
OUT_FEATURES = (256, 128, 128)  # wq, wk, wv


def _norm_block(recipe, dtype, *, link: bool, names=("wq", "wk", "wv")):
    torch.manual_seed(0)
    norm = hd.RMSNorm(SHAPE_BSD[-1], eps=1e-6, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(SHAPE_BSD[-1]) + 0.5)
    lins = [hd.Linear(SHAPE_BSD[-1], n, bias=False, recipe=recipe, name=name, dtype=dtype)
            for n, name in zip(OUT_FEATURES, names)]
    if link:
        hd.link_quantized_input(norm, consumers=lins)
    return norm, lins


def _run_norm_block(norm, lins, x, *, checkpoint=False):
    """Outputs, then the gradients of x, the norm weight and each linear weight."""
    x = x.detach().clone().requires_grad_(True)

    def block(x):
        h = norm(x)
        return [lin(h) for lin in lins]

    outs = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if checkpoint else block(x)
    loss = sum((o.float() * torch.linspace(-1, 1, o.shape[-1])).sum() for o in outs)
    loss.backward()
    return [o.detach() for o in outs] + [x.grad, norm.weight.grad] + [lin.weight.grad for lin in lins]


def _assert_all_bitwise(a, b, what):
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        assert_bitwise_equal(u, v, f"{what}: tensor {i}")


def _x(dtype, shape=SHAPE_BSD, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * torch.rand(shape[:-1] + (1,), generator=g) * 4).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", RECIPES)
def test_norm_to_three_linears_fused_equals_unfused(name, dtype):
    recipe = hd.recipe_from_name(name)
    x = _x(dtype)
    norm, _ = _norm_block(recipe, dtype, link=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        h = norm(x)
        fused = _run_norm_block(*_norm_block(recipe, dtype, link=True), x)
    assert isinstance(h, hd.QuantizedTensor) == (name not in STATEFUL), name
    if name not in STATEFUL:
        assert not [w for w in seen if "not sharing" in str(w.message)], name
        assert h.dtype == dtype and h.shape == x.shape and h.columnwise is not None
    unfused = _run_norm_block(*_norm_block(recipe, dtype, link=False), x)
    _assert_all_bitwise(fused, unfused, f"{name} {dtype} fused vs unfused")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", RECIPES)
def test_swiglu_to_linear_fused_equals_unfused(name, dtype):
    recipe = hd.recipe_from_name(name)
    g = torch.Generator().manual_seed(2)
    a0, b0 = (torch.randn(SHAPE_BSD, generator=g).mul(3).to(dtype) for _ in range(2))

    def run(link):
        torch.manual_seed(0)
        act, w2 = hd.SwiGLU(), hd.Linear(SHAPE_BSD[-1], 128, bias=False, recipe=recipe, name="w2", dtype=dtype)
        if link:
            hd.link_quantized_input(act, consumers=[w2])
        a, b = a0.clone().requires_grad_(True), b0.clone().requires_grad_(True)
        h = act(a, b)
        assert isinstance(h, hd.QuantizedTensor) == (link and name not in STATEFUL)
        y = w2(h)
        (y.float() * torch.linspace(-1, 1, 128)).sum().backward()
        return [y.detach(), a.grad, b.grad, w2.weight.grad]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp8_delayed warns that it falls back
        _assert_all_bitwise(run(True), run(False), f"{name} {dtype} swiglu fused vs unfused")


@pytest.mark.parametrize("name", ["fp8_current", "mxfp8", "nvfp4", "mxfp8_fwd_nvfp4_bwd", "fp8_delayed"])
def test_checkpointed_fused_block_reproduces_unfused_gradients(name):
    recipe = hd.recipe_from_name(name)
    x = _x(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fused = _run_norm_block(*_norm_block(recipe, torch.bfloat16, link=True), x, checkpoint=True)
    unfused = _run_norm_block(*_norm_block(recipe, torch.bfloat16, link=False), x)
    _assert_all_bitwise(fused, unfused, f"{name} checkpointed fused vs unfused")


def test_checkpoint_under_autocast_reuses_the_forward_recipe():
    """Consumers without their own recipe: the recompute (outside ``hd.autocast``) must
    still fuse with the forward's recipe, or the saved tensors would not match."""
    recipe = hd.recipe_from_name("fp8_current")
    x = _x(torch.bfloat16)
    norm, lins = _norm_block(None, torch.bfloat16, link=True)
    with hd.autocast(recipe):
        assert isinstance(norm(x), hd.QuantizedTensor)
        fused = _run_norm_block(norm, lins, x, checkpoint=True)
    norm, lins = _norm_block(recipe, torch.bfloat16, link=False)
    _assert_all_bitwise(fused, _run_norm_block(norm, lins, x), "autocast checkpoint")


def test_norm_output_is_quantized_once_per_forward():
    recipe = hd.recipe_from_name("fp8_current")
    x = _x(torch.bfloat16)
    m = x.numel() // x.shape[-1]
    calls = []
    original = hd.Float8Quantizer.quantize_storages

    def counting(self, x2d, **kw):
        if tuple(x2d.shape) == (m, SHAPE_BSD[-1]):
            calls.append(kw)
        return original(self, x2d, **kw)

    for link, expect in ((True, 1), (False, 3)):
        norm, lins = _norm_block(recipe, torch.bfloat16, link=link)
        calls.clear()
        with mock.patch.object(hd.Float8Quantizer, "quantize_storages", counting):
            h = norm(x.requires_grad_(False))
            for lin in lins:
                lin(h)
        assert len(calls) == expect, f"link={link}: {len(calls)} quantizations of the norm output"
        assert all(c["rowwise"] and c["columnwise"] for c in calls)
    with torch.no_grad():  # no gradient wanted: rowwise only
        norm, lins = _norm_block(recipe, torch.bfloat16, link=True)
        calls.clear()
        with mock.patch.object(hd.Float8Quantizer, "quantize_storages", counting):
            h = norm(x)
        assert h.columnwise is None and [c["columnwise"] for c in calls] == [False]


def test_no_recipe_gives_plain_output_without_warning():
    norm, lins = _norm_block(None, torch.float32, link=True)
    x = _x(torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        h = norm(x)
    assert type(h) is torch.Tensor
    assert_bitwise_equal(h, torch.nn.functional.rms_norm(x, (x.shape[-1],), norm.weight, 1e-6), "no recipe")


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Forget earlier one-time warnings (other tests in this process may have shown them)."""
    from hybrid_dist import warn as _warn

    monkeypatch.setattr(_warn, "_WARNED", set())


def test_mismatched_consumer_quantizers_fall_back_and_warn_once(fresh_warnings):
    x = _x(torch.float32)
    mx, f8 = hd.recipe_from_name("mxfp8"), hd.recipe_from_name("fp8_current")

    def build(link):
        norm, lins = _norm_block(mx, torch.float32, link=False, names=("mm.wq", "mm.wk", "mm.wv"))
        lins[1].recipe = f8
        if link:
            hd.link_quantized_input(norm, consumers=lins)
        return norm, lins

    norm, lins = build(True)
    with pytest.warns(UserWarning, match=r"mm.wq, mm.wk, mm.wv.*input quantizers differ"):
        assert type(norm(x)) is torch.Tensor
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the second forward is silent
        fused = _run_norm_block(norm, lins, x)
    _assert_all_bitwise(fused, _run_norm_block(*build(False), x), "mismatched consumers")


def test_delayed_scaling_falls_back_and_warns_once_per_producer_class(fresh_warnings):
    def build(layer):
        return _norm_block(hd.recipe_from_name("fp8_delayed"), torch.float32, link=True,
                           names=(f"{layer}.wq", f"{layer}.wk", f"{layer}.wv"))[0]

    with pytest.warns(UserWarning, match=r"\[0.wq, 0.wk, 0.wv\].*keeps state per consumer"):
        assert type(build(0)(_x(torch.float32))) is torch.Tensor
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # another layer, same reason: silent
        assert type(build(1)(_x(torch.float32))) is torch.Tensor


def test_quantized_input_with_another_quantizer_raises():
    lin = hd.Linear(256, 128, bias=False, recipe=hd.recipe_from_name("fp8_current"), name="layers.0.wq")
    t = hd.MXFP8Quantizer().quantize(torch.randn(128, 256))
    with pytest.raises(ValueError, match=r"'layers.0.wq'.*MXFP8Quantizer.*Float8Quantizer"):
        lin(t)
    with pytest.raises(ValueError, match="without a recipe"):
        hd.Linear(256, 128, name="plain")(t)
    t = hd.Float8Quantizer().quantize(torch.randn(128, 256), columnwise=False)
    with torch.no_grad():  # no wgrad: rowwise is enough
        lin(t)
    with pytest.raises(ValueError, match="wgrad needs the columnwise direction of input"):
        lin(t)
    delayed = hd.Linear(256, 128, bias=False, recipe=hd.recipe_from_name("fp8_delayed"), name="d")
    q = hd.Float8Quantizer(scaling="delayed")
    with pytest.raises(ValueError, match="keeps state"):
        delayed(q.quantize(torch.randn(128, 256), state=q.make_state()))


def test_link_bad_arguments():
    norm = hd.RMSNorm(256)
    with pytest.raises(ValueError, match="hd.RMSNorm or hd.SwiGLU"):
        hd.link_quantized_input(torch.nn.RMSNorm(256), consumers=[hd.Linear(256, 8)])
    with pytest.raises(ValueError, match="hd.Linear modules"):
        hd.link_quantized_input(norm, consumers=[torch.nn.Linear(256, 8)])
    with pytest.raises(ValueError, match=r"in_features \[128\].*last dim 256"):
        hd.link_quantized_input(norm, consumers=[hd.Linear(128, 8)])
    lin = hd.Linear(256, 8)
    with pytest.raises(ValueError, match="listed twice"):
        hd.link_quantized_input(norm, consumers=[lin, lin])
    hd.link_quantized_input(norm, consumers=[lin])
    hd.link_quantized_input(norm, consumers=[])  # unlinks
    assert norm._hd_consumers == ()


def test_rms_norm_is_a_drop_in_for_nn_rmsnorm():
    """Same state dict and bitwise the same outputs and gradients as ``nn.RMSNorm``, fp32
    and bf16 (``hd.RMSNorm`` is ``F.rms_norm``, plain or before one shared quantize)."""
    ref = torch.nn.RMSNorm(256)
    ours = hd.RMSNorm(256)
    assert isinstance(ours, torch.nn.RMSNorm) and list(ours.state_dict()) == list(ref.state_dict()) == ["weight"]
    with torch.no_grad():
        ref.weight.copy_(torch.rand(256) + 0.5)
    ours.load_state_dict(ref.state_dict())
    for dtype in (torch.float32, torch.bfloat16):
        r, o = ref.to(dtype), ours.to(dtype)
        x = _x(dtype)
        xr, xo = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        yr, yo = r(xr), o(xo)
        assert_bitwise_equal(yo, yr, f"{dtype} output")
        dy = torch.randn_like(yr)
        yr.backward(dy)
        yo.backward(dy)
        assert_bitwise_equal(xo.grad, xr.grad, f"{dtype} input gradient")
        assert_bitwise_equal(o.weight.grad, r.weight.grad, f"{dtype} weight gradient")
        r.weight.grad = o.weight.grad = None


