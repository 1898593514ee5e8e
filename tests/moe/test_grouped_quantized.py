"""The sync-free quantized grouped path (``moe.grouped_quantized``) run on CPU, where its
two torch kernels are emulated by a loop over groups (and each call's arguments pass the
kernels' meta checks: shapes, strides, dtypes, as the installed torch registers them).

Against the reference GroupedLinear (loop of per-expert GEMMs, fp32 products of exact
block values, one rounding): the grouped path rounds to bf16 once more where it folds
per-expert per-tensor scales (FP8, NVFP4) or FP8 block scales into an operand, and FP8
E4M3 pairs use the scaled kernel's math. Measured (seed 0, these shapes): bitwise for
MXFP8, FP8 blocks (power-of-2 scales), bf16 and bf16_fwd_mxfp8_bwd; 51-135 dB for
per-tensor FP8 and NVFP4 fprop. NVFP4 stochastic rounding draws other random numbers
than the reference (``device_split`` doc), so dgrad/wgrad of the SR recipes are compared
through their error against high precision instead.
"""

import pytest
import torch

import hybrid_dist as hd
from hybrid_dist.moe import GroupedLinear, grouped_quantized
from tests._helpers import sqnr_db

E, K, N = 4, 128, 128
SPLITS = [37, 0, 90, 73]
SR_RECIPES = ("nvfp4", "mxfp8_fwd_nvfp4_bwd")
FLOOR_DB = 45.0  # grouped vs reference, non-SR GEMMs (measured >= 51 dB)
SR_SLACK_DB = 2.0  # SR GEMMs: error vs high precision at most this much worse than the reference's


def _modules(recipe, quantized_init: bool, e: int, k: int, n: int):
    mods = []
    for _ in range(2):
        torch.manual_seed(0)
        if quantized_init:
            with hd.quantized_model_init(recipe):
                mods.append(GroupedLinear(e, k, n, recipe=recipe, dtype=torch.bfloat16))
        else:
            mods.append(GroupedLinear(e, k, n, recipe=recipe, dtype=torch.bfloat16))
    return mods


def _high_precision(weight, x, dy, splits):
    w = weight.dequantize() if hasattr(weight, "dequantize") else weight.detach()
    xs, dys = torch.split(x.float(), splits), torch.split(dy.float(), splits)
    y = torch.cat([a @ w[i].float().t() for i, a in enumerate(xs)])
    dx = torch.cat([d @ w[i].float() for i, d in enumerate(dys)])
    dw = torch.stack([d.t() @ a for d, a in zip(dys, xs)])
    return y, dx, dw


def run_paths(recipe, *, quantized_init: bool, steps: int = 2, splits=SPLITS, k=K, n=N):
    """Reference GroupedLinear and the grouped path on the same inputs and states; yields
    ``(what, grouped, reference, high_precision)`` per tensor and step."""
    g_ref, g_new = _modules(recipe, quantized_init, len(splits), k, n)
    tpe = torch.tensor(splits)
    plan = g_new.plan(recipe)
    reason = grouped_quantized.unsupported_reason(plan, torch.zeros(1, k, dtype=torch.bfloat16), g_new.weight)
    assert reason is None, f"{recipe.name}: grouped path refused: {reason}"
    for step in range(steps):
        x = torch.randn(sum(splits), k, dtype=torch.bfloat16) * (step + 1)
        dy = torch.randn(sum(splits), n, dtype=torch.bfloat16)
        x_ref, x_new = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        y_ref = g_ref(x_ref, tpe)
        y_ref.backward(dy)
        plan.advance("input")  # as GroupedLinear.forward does before either path
        plan.advance("weight")
        y_new = grouped_quantized.grouped_linear(x_new, g_new.weight, tpe, plan)
        y_new.backward(dy)
        hp = _high_precision(g_new.weight, x, dy, splits)
        for what, a, b, h in zip(("y", "dx", "dW"), (y_new, x_new.grad, g_new.weight.grad),
                                 (y_ref, x_ref.grad, g_ref.weight.grad), hp):
            yield f"{recipe.name} quantized_init={quantized_init} step={step} {what}", a, b, h
        for i, m in enumerate(splits):
            if m == 0:
                assert torch.count_nonzero(g_new.weight.grad[i]) == 0, f"{recipe.name}: empty expert {i} got dW"
        g_ref.weight.grad = g_new.weight.grad = None


def _check(recipe, quantized_init, steps=2, splits=SPLITS, k=K, n=N):
    for what, got, ref, hp in run_paths(recipe, quantized_init=quantized_init, steps=steps, splits=splits, k=k, n=n):
        assert got.dtype == ref.dtype and got.shape == ref.shape, what
        if got.numel() == 0:
            continue
        sr = recipe.name in SR_RECIPES and not what.endswith(" y")
        if sr:
            got_db, ref_db = sqnr_db(hp, got.float()), sqnr_db(hp, ref.float())
            assert got_db >= ref_db - SR_SLACK_DB, f"{what}: {got_db:.1f} dB vs reference {ref_db:.1f} dB (to fp32)"
        else:
            db = sqnr_db(ref.float(), got.float())
            assert db > FLOOR_DB, f"{what}: grouped vs reference {db:.1f} dB <= {FLOOR_DB}"


@pytest.mark.parametrize("recipe_name", hd.RECIPE_NAMES)
def test_grouped_path_matches_reference(recipe_name):
    _check(hd.recipe_from_name(recipe_name), quantized_init=False)


@pytest.mark.parametrize("recipe_name", ["fp8_current", "mxfp8", "nvfp4", "fp8_block"])
def test_grouped_path_quantized_init(recipe_name):
    _check(hd.recipe_from_name(recipe_name), quantized_init=True, steps=1)


def test_all_e4m3_custom_recipe_uses_scaled_kernel_in_all_gemms():
    """E4M3 gradients: dgrad (2d x 3d) and wgrad (2d x 2d, groups along tokens) go
    through ``_scaled_grouped_mm``'s argument checks too; splits with an empty expert
    first and last."""
    from unittest import mock

    f = hd.Float8Quantizer()
    recipe = hd.CustomRecipe(lambda role: f, name="fp8_e4m3_all")
    with mock.patch.object(grouped_quantized, "_scaled_grouped_mm", wraps=grouped_quantized._scaled_grouped_mm) as k:
        _check(recipe, quantized_init=False, steps=1, splits=[0, 100, 100, 0])
    assert k.call_count == 3, f"_scaled_grouped_mm ran {k.call_count} times for fprop, dgrad, wgrad"
    with mock.patch.object(grouped_quantized, "_scaled_grouped_mm", wraps=grouped_quantized._scaled_grouped_mm) as k:
        _check(hd.recipe_from_name("fp8_current"), quantized_init=False, steps=1)
    assert k.call_count == 1, "fp8_current: only fprop (E4M3 x E4M3) uses the scaled kernel (grads are E5M2)"


def test_refusals_name_the_reason():
    recipe = hd.recipe_from_name("mxfp8")
    g = GroupedLinear(E, K, N, recipe=recipe, dtype=torch.bfloat16)
    plan = g.plan(recipe)
    assert "bf16 only" in grouped_quantized.unsupported_reason(plan, torch.zeros(1, K), g.weight)
    g40 = GroupedLinear(E, 40, N, recipe=hd.recipe_from_name("fp8_current"), dtype=torch.bfloat16)
    reason = grouped_quantized.unsupported_reason(g40.plan(g40.recipe), torch.zeros(1, 40, dtype=torch.bfloat16),
                                                  g40.weight)
    assert "multiples of 16" in reason
    rht_w = hd.CustomRecipe(lambda role: hd.NVFP4Quantizer(rht=True, rht_seed=1 if role.tensor_type == "weight" else 0))
    g_rht = GroupedLinear(E, K, N, recipe=rht_w, dtype=torch.bfloat16)
    reason = grouped_quantized.unsupported_reason(g_rht.plan(rht_w), torch.zeros(1, K, dtype=torch.bfloat16),
                                                  g_rht.weight)
    assert "Hadamard" in reason
    assert not grouped_quantized.fits(plan, torch.zeros(1, K, dtype=torch.bfloat16), g.weight)  # CPU: reference


def test_emulated_kernels_equal_torch_grouped_mm_on_cpu():
    """The CPU emulation against torch's own CPU ``_grouped_mm`` (torch >= 2.13 has one)
    for the exact operand layouts the grouped path passes (2d x 3d with a column-major
    mat_b, 2d x 2d with groups along the contraction dim, an empty group)."""
    from hybrid_dist.moe.grouped_quantized import _emulated

    torch.manual_seed(0)
    offs = torch.tensor([32, 32, 80], dtype=torch.int32)
    a = torch.randn(96, 64, dtype=torch.bfloat16)
    b = torch.randn(3, 48, 64, dtype=torch.bfloat16).transpose(1, 2)
    at, bt = torch.randn(48, 96, dtype=torch.bfloat16), torch.randn(64, 96, dtype=torch.bfloat16).t()
    try:
        want_rows, want_tok = torch._grouped_mm(a, b, offs=offs), torch._grouped_mm(at, bt, offs=offs)
    except (RuntimeError, NotImplementedError) as err:
        pytest.skip(f"torch._grouped_mm has no CPU kernel here: {err}")
    got_rows, got_tok = _emulated(a, b, offs), _emulated(at, bt, offs)
    assert sqnr_db(want_rows[:80].float(), got_rows[:80].float()) > 60
    assert sqnr_db(want_tok.float(), got_tok.float()) > 60


@pytest.mark.parametrize("splits", [[0, 0, 200, 0], [0, 0, 0, 0]], ids=["one_expert", "no_tokens"])
def test_grouped_path_all_tokens_on_one_expert_and_no_tokens(splits):
    _check(hd.recipe_from_name("mxfp8_fwd_nvfp4_bwd"), quantized_init=False, steps=1, splits=splits)


@pytest.mark.parametrize("recipe_name", ["nvfp4", "fp8_current"])
def test_grouped_path_with_more_tokens_than_weight_rows(recipe_name):
    """More packed tokens than expert-weight rows (and N > K): the per-expert scales go on
    x's columns in wgrad (the other wgrad fold branch)."""
    _check(hd.recipe_from_name(recipe_name), quantized_init=False, steps=1, splits=[500, 300], k=128, n=256)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("recipe_name", ["nvfp4", "fp8_current"])
def test_an_experts_rows_do_not_depend_on_the_other_experts_rows(recipe_name, device, monkeypatch):
    """Expert 0's 40 rows, alone or beside 600 rows of expert 1 (more packed rows than the
    experts' weight rows, so a fold chosen by size would move to the other operand): fprop
    and dgrad rows of expert 0 bitwise the same (NVFP4: fprop; its gradients' stochastic
    rounding draws by packed position). Expert parallelism relies on it: a rank's rows for
    an expert do not depend on what the other ranks route. On CUDA the packed path's own
    kernels; on CPU its emulation."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setattr(grouped_quantized, "fits", lambda plan, x, w: grouped_quantized.unsupported_reason(
        plan, x, w) is None)  # the packed path on CPU too (its emulated kernels)
    recipe = hd.recipe_from_name(recipe_name)
    torch.manual_seed(0)
    mod = GroupedLinear(2, K, N, recipe=recipe, dtype=torch.bfloat16, device=device)
    new = dict(dtype=torch.bfloat16, device=device)
    x0, dy0 = torch.randn(40, K, **new), torch.randn(40, N, **new)
    x1, dy1 = torch.randn(600, K, **new), torch.randn(600, N, **new)
    out = {}
    for name, x, dy, counts in (("alone", x0, dy0, [40, 0]), ("beside", torch.cat([x0, x1]), torch.cat([dy0, dy1]),
                                                                       [40, 600])):
        x = x.clone().requires_grad_(True)
        y = mod(x, torch.tensor(counts, device=device))
        y.backward(dy)
        out[name] = (y[:40].detach(), x.grad[:40])
    checked = ("y", "dx") if recipe_name == "fp8_current" else ("y",)
    for what, a, b in zip(checked, out["alone"], out["beside"]):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{recipe_name} expert 0 {what} on {device}"


@pytest.mark.parametrize("grads", ["x_only", "weight_only", "none"])
def test_grouped_path_partial_gradients(grads):
    """Frozen weights (dgrad only), an input without grad (wgrad only) and no_grad: the
    directions not needed are not made, and the gradients made equal the full run's."""
    recipe = hd.recipe_from_name("fp8_current")
    g_full, g_part = _modules(recipe, False, E, K, N)
    tpe = torch.tensor(SPLITS)
    x = torch.randn(sum(SPLITS), K, dtype=torch.bfloat16)
    dy = torch.randn(sum(SPLITS), N, dtype=torch.bfloat16)
    outs = []
    for g, part in ((g_full, False), (g_part, True)):
        plan = g.plan(recipe)
        plan.advance("input")
        plan.advance("weight")
        g.weight.requires_grad_(not (part and grads in ("x_only", "none")))
        xi = x.clone().requires_grad_(not (part and grads in ("weight_only", "none")))
        if part and grads == "none":
            with torch.no_grad():
                outs.append((grouped_quantized.grouped_linear(xi, g.weight, tpe, plan), None, None))
            continue
        y = grouped_quantized.grouped_linear(xi, g.weight, tpe, plan)
        y.backward(dy)
        outs.append((y.detach(), xi.grad, g.weight.grad))
    (y_f, dx_f, dw_f), (y_p, dx_p, dw_p) = outs
    assert torch.equal(y_f, y_p), f"{grads}: forward differs"
    if grads == "x_only":
        assert dw_p is None and torch.equal(dx_p, dx_f)
    if grads == "weight_only":
        assert dx_p is None and torch.equal(dw_p, dw_f)


@pytest.mark.parametrize("recipe_name", ["fp8_current", "mxfp8"])
def test_grouped_path_reads_the_quantized_weights_columnwise_in_backward(recipe_name):
    """FSDP2 gathers a quantized weight's rowwise direction for the forward and refills its
    columnwise buffers before the backward (``fsdp2/_hooks.py`` note), so the dgrad must read
    the columnwise bytes as they are in backward; a copy taken in forward held stale bytes
    (NaN gradients from the second step of an MoE launcher run on a GPU). The columnwise
    buffers (the per-tensor scale is the shard's own, not re-gathered) hold 0xFF bytes (NaN)
    through the forward and are refilled before the backward: y, dx and dW are bitwise the
    run with valid buffers throughout."""
    recipe = hd.recipe_from_name(recipe_name)
    torch.manual_seed(0)
    with hd.quantized_model_init(recipe):
        g = GroupedLinear(E, K, N, recipe=recipe, dtype=torch.bfloat16)
    plan, tpe = g.plan(recipe), torch.tensor(SPLITS)
    x = torch.randn(sum(SPLITS), K, dtype=torch.bfloat16)
    dy = torch.randn(sum(SPLITS), N, dtype=torch.bfloat16)
    col = g.weight.storage_of("columnwise")
    valid = {f: t.clone() for f, t in col.tensors().items() if t.dim()}

    def refill(stale: bool) -> None:
        with torch.no_grad():
            for f, t in col.tensors().items():
                if f not in valid:
                    continue
                with torch.autograd._unsafe_preserve_version_counter(t):
                    t.view(torch.uint8).fill_(0xFF) if stale else t.copy_(valid[f])

    runs = []
    for stale in (False, True):
        refill(stale)
        xi = x.clone().requires_grad_(True)
        y = grouped_quantized.grouped_linear(xi, g.weight, tpe, plan)
        refill(False)
        y.backward(dy)
        runs.append((y.detach(), xi.grad, g.weight.grad))
        g.weight.grad = None
    for what, a, b in zip(("y", "dx", "dW"), *runs):
        assert torch.equal(a, b), f"{recipe_name}: {what} differs when the columnwise buffers were stale in forward"


def test_compiled_graphs_stack_the_quantized_weights_columnwise_in_backward():
    """Inductor's partitioner (min-cut) moves into the forward graph what depends on forward
    inputs alone, a plain ``narrow`` + ``cat`` of the weight's columnwise fields included,
    where FSDP2 has not refilled them. The dgrad operand's stacking
    (``stack_dim0_segments``) takes the backward's gradient as an ordering input, so it
    stays in the backward graph, and equals ``stack_experts`` of the narrowed experts."""
    from functorch.compile import aot_function, make_boxed_func, min_cut_rematerialization_partition

    from hybrid_dist.formats import Float8Quantizer
    from hybrid_dist.formats.float8 import Float8Storage
    from hybrid_dist.moe.grouped_operands import stack_dim0_segments, stack_experts

    e, n, k = 4, 32, 64
    _, col = Float8Quantizer().quantize_storages(torch.randn(e * n, k), rowwise=False, columnwise=True)

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, data, scale_inv):
            ctx.save_for_backward(data, scale_inv)
            return x * 2

        @staticmethod
        def backward(ctx, dy):
            data, scale_inv = ctx.saved_tensors
            st = Float8Storage(data=data, scale_inv=scale_inv, transposed=True)
            w = stack_dim0_segments(st, e, dy).storage
            return dy + w.data.float().sum() * w.scale_inv.sum(), None, None

    graphs = {}

    def keep(name):
        def compiler(gm, _):
            graphs[name] = {str(nd.target) for nd in gm.graph.nodes if nd.op == "call_function"}
            return make_boxed_func(gm.forward)
        return compiler

    fn = aot_function(lambda x, d, s: Fn.apply(x, d, s), fw_compiler=keep("fw"), bw_compiler=keep("bw"),
                      partition_fn=min_cut_rematerialization_partition)
    fn(torch.randn(8, requires_grad=True), col.data, col.scale_inv).sum().backward()
    op = "hybrid_dist.stack_segments.default"
    assert op in graphs["bw"] and op not in graphs["fw"], f"stack_segments: forward {graphs['fw']}"
    got = stack_dim0_segments(col, e, torch.zeros(())).storage
    want = stack_experts([col.narrow_dim0(i * n, n) for i in range(e)]).storage
    assert all(torch.equal(a, b) for a, b in zip(got.tensors().values(), want.tensors().values()))
