"""GPU (``@pytest.mark.gpu``, skipped without CUDA): GroupedLinear on CUDA against the
hd.Linear loop (the reference), the ``torch._grouped_mm`` bf16 path, the sync-free
quantized grouped path (``grouped_quantized``: ``split_quantize_packed`` +
``torch._scaled_grouped_mm`` for E4M3 pairs, the Triton grouped FP8 kernels for pairs with
an E5M2 operand, ``torch._grouped_mm`` otherwise), and no device-to-host sync in the
forward and backward of the grouped paths and of the dropless MoE layer.

Tolerances of the quantized grouped path against the reference loop (same inputs, same
quantizer states): SQNR > 35 dB for y, dx and dW of every recipe without stochastic
rounding (CPU emulation of the same math measures >= 51 dB; on the GPU the accumulation
order differs too). NVFP4 stochastic rounding draws other random numbers than the
reference (``device_split`` doc), so the SR recipes' dx and dW are compared through their
error against an fp32 computation from the same quantized weights: at most 2 dB worse
than the reference's.
"""

import pytest
import torch

import hybrid_dist as hd
from hybrid_dist.moe import GroupedLinear, MoE, grouped_quantized
from hybrid_dist.quantized_tensor import QuantizedTensor
from tests._helpers import sqnr_db
from tests.moe._reference import LinearLoop
from tests.moe.test_grouped_linear import SPLITS, run_both

pytestmark = pytest.mark.gpu


QUANTIZED = [n for n in hd.RECIPE_NAMES if n != "bf16"]
SR_RECIPES = ("nvfp4", "mxfp8_fwd_nvfp4_bwd")
FLOOR_DB, SR_SLACK_DB = 35.0, 2.0
# uneven, zero-token experts (first, middle, last), sizes not multiples of 16/32/128
SHAPES = {"small": (4, 128, 128, [37, 0, 90, 73]), "wide": (8, 512, 256, [0, 301, 17, 0, 640, 1, 129, 0])}


def _hp(weight, x, dy, splits):
    w = weight.dequantize() if isinstance(weight, QuantizedTensor) else weight.detach()
    xs, dys = torch.split(x.float(), splits), torch.split(dy.float(), splits)
    return (torch.cat([a @ w[i].float().t() for i, a in enumerate(xs)]),
            torch.cat([d @ w[i].float() for i, d in enumerate(dys)]),
            torch.stack([d.t() @ a for d, a in zip(dys, xs)]))


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("quantized_init", [False, True], ids=["hp_weight", "quantized_init"])
@pytest.mark.parametrize("recipe_name", QUANTIZED)
def test_grouped_quantized_path_close_to_linear_loop(recipe_name, quantized_init, shape):
    e, k, n, splits = SHAPES[shape]
    recipe = hd.recipe_from_name(recipe_name)
    torch.manual_seed(0)
    if quantized_init:
        with hd.quantized_model_init(recipe):
            g = GroupedLinear(e, k, n, recipe=recipe, device="cuda", dtype=torch.bfloat16)
    else:
        g = GroupedLinear(e, k, n, recipe=recipe, device="cuda", dtype=torch.bfloat16)
    loop = LinearLoop(g.weight, recipe)
    tpe = torch.tensor(splits, device="cuda")
    for step in range(2):
        x = torch.randn(sum(splits), k, device="cuda", dtype=torch.bfloat16) * (step + 1)
        dy = torch.randn(sum(splits), n, device="cuda", dtype=torch.bfloat16)
        assert grouped_quantized.fits(g.plan(recipe), x, g.weight), grouped_quantized.unsupported_reason(
            g.plan(recipe), x, g.weight)
        xg = x.clone().requires_grad_(True)
        y = g(xg, tpe)
        y.backward(dy)
        ref = loop.run(x, splits, dy)
        hp = _hp(g.weight, x, dy, splits)
        for what, got, want, h in zip(("y", "dx", "dW"), (y, xg.grad, g.weight.grad), ref, hp):
            tag = f"{recipe_name} {shape} quantized_init={quantized_init} step={step} {what}"
            assert got.shape == want.shape and got.dtype == want.dtype, tag
            assert torch.isfinite(got.float()).all(), f"{tag}: non-finite"
            if recipe_name in SR_RECIPES and what != "y":
                got_db, ref_db = sqnr_db(h, got.float()), sqnr_db(h, want.float())
                assert got_db >= ref_db - SR_SLACK_DB, f"{tag}: {got_db:.1f} dB vs reference {ref_db:.1f} dB to fp32"
            else:
                db = sqnr_db(want.float(), got.float())
                assert db > FLOOR_DB, f"{tag}: grouped vs loop {db:.1f} dB <= {FLOOR_DB}"
        for i, m in enumerate(splits):
            if m == 0:
                assert torch.count_nonzero(g.weight.grad[i]) == 0, f"{recipe_name} {shape}: empty expert {i} got dW"
        g.weight.grad = None


@pytest.mark.parametrize("recipe_name", ["fp8_current", "fp8_delayed"])
def test_fp8_e5m2_pairs_without_triton_close_to_linear_loop(recipe_name, monkeypatch):
    """The route a compiled graph takes for FP8 pairs with an E5M2 operand (no Triton
    grouped kernel: per-expert scales folded into one operand, then ``torch._grouped_mm``),
    run eager on CUDA: y, dx and dW within the same SQNR floor of the reference loop."""
    monkeypatch.setattr(grouped_quantized, "_triton_fp8", lambda a, b: False)
    e, k, n, splits = SHAPES["wide"]
    recipe = hd.recipe_from_name(recipe_name)
    torch.manual_seed(0)
    g = GroupedLinear(e, k, n, recipe=recipe, device="cuda", dtype=torch.bfloat16)
    loop = LinearLoop(g.weight, recipe)
    tpe = torch.tensor(splits, device="cuda")
    x = torch.randn(sum(splits), k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(sum(splits), n, device="cuda", dtype=torch.bfloat16) * 1e-6  # small: scales far from 1
    assert grouped_quantized.fits(g.plan(recipe), x, g.weight), "the grouped quantized path should serve this call"
    xg = x.clone().requires_grad_(True)
    y = g(xg, tpe)
    y.backward(dy)
    ref = loop.run(x, splits, dy)
    for what, got, want in zip(("y", "dx", "dW"), (y.detach(), xg.grad, g.weight.grad), ref):
        db = sqnr_db(want.float(), got.float())
        assert db > FLOOR_DB, f"{recipe_name} without Triton, {what}: grouped vs loop {db:.1f} dB <= {FLOOR_DB}"


@pytest.mark.parametrize("recipe", ["fp8_current", "fp8_delayed"])
def test_batched_fp8_weights_bitwise_the_expert_loop(recipe):
    """The batched kernel's stacked weight operands equal the per-expert quantize-then-stack
    path byte for byte (data, transposed data, scale_inv); under delayed scaling it reads each
    expert's scale and records the same amax histories (each path on its own copy of the states)."""
    import copy

    from hybrid_dist.moe.grouped_operands import batched_fp8_weights, expert_weight_storages, stack_experts

    g = GroupedLinear(5, 384, 256, recipe=hd.recipe_from_name(recipe), device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        g.weight.mul_(torch.tensor([1.0, 100.0, 1e-3, 0.0, 7.0], device="cuda")[:, None, None])
    plan = g.plan(hd.recipe_from_name(recipe))
    for i, st in enumerate(plan.states["weight"]):
        if hasattr(st, "amax_history"):  # delayed: a different scale per expert
            st.to("cuda")
            st.scale.fill_(2.0 ** (3 * i - 4))
    loop_plan = copy.copy(plan)
    loop_plan.states = copy.deepcopy(plan.states)
    got = batched_fp8_weights(g.weight, plan, need_dgrad=True)
    assert got is not None, f"{recipe} bf16 CUDA weights should take the batched kernel"
    rows, cols = expert_weight_storages(g.weight, loop_plan, need_dgrad=True)
    for what, a, b in (("rowwise", got[0], stack_experts(rows)), ("columnwise", got[1], stack_experts(cols))):
        assert a.storage.same_meta(b.storage), what
        assert torch.equal(a.storage.data.view(torch.uint8), b.storage.data.view(torch.uint8)), \
            f"{recipe} {what}: bytes"
        assert torch.equal(a.scale, b.scale), f"{recipe} {what}: scale_inv"
    for i, (a, b) in enumerate(zip(plan.states["weight"], loop_plan.states["weight"])):
        if hasattr(a, "amax_history"):
            assert torch.equal(a.amax_history, b.amax_history), f"{recipe} expert {i}: amax history"


def test_bf16_grouped_mm_close_to_linear_loop():
    def close(a, b, what):
        assert sqnr_db(b.float(), a.float()) > 40, f"{what}: SQNR {sqnr_db(b.float(), a.float()):.1f} dB"

    run_both("bf16", quantized_init=False, steps=1, device="cuda", check=close)


class _SyncError:
    """``torch.cuda.set_sync_debug_mode("error")`` inside the block, restored after; except
    inside an eager NVFP4 split (``device_split._per_expert_nvfp4_slices``), whose one read
    of the padded offsets is documented (its calls are counted in ``nvfp4_splits``)."""

    def __enter__(self):
        from hybrid_dist.moe import device_split

        torch.cuda.synchronize()
        self.prev = torch.cuda.get_sync_debug_mode()
        self.nvfp4_splits = 0
        self.real = real = device_split._per_expert_nvfp4_slices

        def allowed(*args, **kwargs):
            self.nvfp4_splits += 1
            torch.cuda.set_sync_debug_mode(0)
            try:
                return real(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("error")

        device_split._per_expert_nvfp4_slices = allowed
        torch.cuda.set_sync_debug_mode("error")
        return self

    def __exit__(self, *exc):
        from hybrid_dist.moe import device_split

        torch.cuda.set_sync_debug_mode(self.prev)
        device_split._per_expert_nvfp4_slices = self.real


def test_grouped_linear_bf16_no_host_sync():
    g = GroupedLinear(4, 128, 256, recipe=hd.recipe_from_name("bf16"), device="cuda", dtype=torch.bfloat16)
    x = torch.randn(sum(SPLITS), 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    tpe = torch.tensor(SPLITS, device="cuda")
    dy = torch.randn(sum(SPLITS), 256, device="cuda", dtype=torch.bfloat16)
    with _SyncError():
        y = g(x, tpe)
        y.backward(dy)
    assert x.grad is not None and g.weight.grad.shape == (4, 256, 128)
    assert torch.count_nonzero(g.weight.grad[1]) == 0  # the zero-token expert


@pytest.mark.parametrize("quantized_init", [False, True], ids=["hp_weight", "quantized_init"])
@pytest.mark.parametrize("recipe_name", QUANTIZED)
def test_grouped_linear_quantized_no_host_sync(recipe_name, quantized_init):
    """Warm up once (Triton compiles/autotunes, delayed-scaling states and SR generators
    move to the GPU), then a full forward + backward with sync debug mode "error"
    (an eager NVFP4 split's documented read of its offsets excepted: ``_SyncError``)."""
    recipe = hd.recipe_from_name(recipe_name)
    e, k, n, splits = SHAPES["wide"]
    if quantized_init:
        with hd.quantized_model_init(recipe):
            g = GroupedLinear(e, k, n, recipe=recipe, device="cuda", dtype=torch.bfloat16)
    else:
        g = GroupedLinear(e, k, n, recipe=recipe, device="cuda", dtype=torch.bfloat16)
    tpe = torch.tensor(splits, device="cuda")
    x = torch.randn(sum(splits), k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(sum(splits), n, device="cuda", dtype=torch.bfloat16)
    assert grouped_quantized.fits(g.plan(recipe), x, g.weight)
    g(x, tpe).backward(dy)  # warm-up
    x.grad = g.weight.grad = None
    with _SyncError():
        y = g(x, tpe)
        y.backward(dy)
    assert torch.isfinite(x.grad.float()).all() and torch.isfinite(g.weight.grad.float()).all()


@pytest.mark.parametrize("recipe_name", [None, "bf16", "fp8_current", "mxfp8", "nvfp4", "fp8_block"])
def test_moe_forward_backward_no_host_sync(recipe_name):
    recipe = hd.recipe_from_name(recipe_name) if recipe_name else None
    moe = MoE(128, 128, 8, 2, recipe=recipe, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    y, aux = moe(x)  # warm-up (first Triton calls, state placement)
    torch.autograd.backward([y, aux], [dy, torch.ones((), device="cuda")])
    x.grad = None
    with _SyncError():
        y, aux = moe(x)
        torch.autograd.backward([y, aux], [dy, torch.ones((), device="cuda")])
    assert torch.isfinite(x.grad.float()).all() and moe.fc1.weight.grad is not None
