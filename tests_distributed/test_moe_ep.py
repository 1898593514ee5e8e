"""Expert parallel over gloo (EP = 2, 4): the MoE layer equals EP = 1, quantized and
high-precision dispatch are bitwise equal (MXFP8 training: y and dx bitwise, the weight
gradients within an SQNR floor, as the receiver requantizes the columnwise direction),
and the bytes on the wire are what the formats say; with the packed grouped path forced on
CPU, the packed dispatch (``fp8_current``: bitwise; ``mxfp8``, ``mxfp8_fwd_nvfp4_bwd``:
requantized columnwise) equals the high-precision one; over one NCCL rank (``gpu``), the packed FP8 dispatch is bitwise the
high-precision one.

EP = 1 reference: one process holds all experts and runs the routed experts on the
concatenation of every rank's tokens (so expert e sees the same rows, in the same order,
as under EP); the router and the shared expert run per rank's tokens, as under EP (CPU
matmul results depend on the row count, so equal shapes are what make bitwise equality
meaningful). Every rank computes the same reference and checks its own slice.
"""

import copy

import pytest
import torch
import torch.distributed as dist

import hybrid_dist as hd
from hybrid_dist.moe import MoE
from tests._helpers import sqnr_db
from tests._tiers import slow
from tests_distributed._harness import run_nccl, run_ranks

H, FFN, E, TOP_K, T = 64, 64, 8, 2, 32  # T tokens per rank
# mxfp8_fwd_nvfp4_bwd: fc1's dW from the NVFP4 columnwise of x's MXFP8 rounding against
# that of x, 21.7 / 21.9 dB measured at EP=2 (two NVFP4 quantizations of nearby values; the
# accuracy against exact dW is tests_distributed/test_moe_ep_columnwise.py's)
NVFP4_FLOOR = 15.0
# (recipe, training): fp8_current sends both payloads quantized; mxfp8 training sends MXFP8
# rows and requantizes the columnwise at the receiver (dW within DW_SQNR_FLOOR_DB of the
# high-precision exchange, not bitwise); mxfp8_fwd_nvfp4_bwd sends MXFP8 rows and quantizes
# the NVFP4 columnwise at the receiver, its dy (NVFP4 SR rowwise) travels high precision;
# nvfp4 training falls back to high precision (NVFP4 rows are not exact inputs for the
# columnwise; SR dy); mxfp8 and nvfp4 inference send their rowwise formats.
DW_SQNR_FLOOR_DB = 80.0  # as tests_distributed/test_moe_ep_columnwise.py (measured there)
REQUANTIZED = {("mxfp8", True): DW_SQNR_FLOOR_DB, ("mxfp8_fwd_nvfp4_bwd", True): NVFP4_FLOOR}  # dW SQNR floors
CONFIGS = [("bf16", True), ("fp8_current", True), ("mxfp8", True), ("nvfp4", True), ("mxfp8", False),
           ("nvfp4", False), ("mxfp8_fwd_nvfp4_bwd", True)]


def _bits(t):
    return t.contiguous().view(torch.int16) if t.element_size() == 2 else t.contiguous().view(torch.int32)


def _same(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    n = int((_bits(a) != _bits(b)).sum())
    assert n == 0, f"{what}: {n} of {a.numel()} elements differ bitwise"


def _build(recipe, group, quantized):
    torch.manual_seed(0)
    return MoE(H, FFN, E, TOP_K, shared_ffn=FFN, recipe=recipe, ep_group=group, quantized_dispatch=quantized,
               dtype=torch.bfloat16)


def _load_slice(ep_moe, ref, rank, world):
    e_l = E // world
    with torch.no_grad():
        for name in ("fc1", "fc2"):
            getattr(ep_moe, name).weight.copy_(getattr(ref, name).weight[rank * e_l:(rank + 1) * e_l])
        ep_moe.router.load_state_dict(ref.router.state_dict())
        ep_moe.shared_expert.load_state_dict(ref.shared_expert.state_dict())


def _reference(ref, xs, dys, training):
    """EP = 1: per-rank router and shared expert, routed experts on all ranks' tokens. Each
    rank's shared expert is a fresh copy, so its NVFP4 SR generator starts where an EP
    rank's does."""
    shared = [copy.deepcopy(ref.shared_expert) for _ in xs]
    xs = [x.clone().requires_grad_(training) for x in xs]
    routes = [ref.router(x) for x in xs]
    routed = ref.routed(torch.cat(xs), torch.cat([r[0] for r in routes]), torch.cat([r[1] for r in routes]))
    ys = [r + sh(x) for r, sh, x in zip(torch.split(routed, T), shared, xs)]
    if training:
        torch.cat(ys).backward(torch.cat(dys))
    return ys, [x.grad for x in xs]


def _run_ep(moe, x, dy, training):
    x = x.clone().requires_grad_(training)
    with torch.set_grad_enabled(training):
        y, _ = moe(x)
        if training:
            y.backward(dy)
    return y.detach(), x.grad


def _expected_dispatch_bytes(ref, xs, rank, world, row_bytes):
    """Rows this rank sends to other ranks × bytes per row."""
    _, experts, _ = ref.router(xs[rank])
    owner = experts.reshape(-1) // (E // world)
    return int((owner != rank).sum()) * row_bytes


def _worker(rank, world, configs):
    group = dist.group.WORLD
    torch.manual_seed(1234)
    xs = list(torch.randn(world * T, H, dtype=torch.bfloat16).split(T))
    dys = list(torch.randn(world * T, H, dtype=torch.bfloat16).split(T))
    report = {}
    for recipe_name, training in configs:
        cfg = f"EP={world} rank={rank} recipe={recipe_name} training={training}"
        recipe = hd.recipe_from_name(recipe_name)
        ref = _build(recipe, None, True)
        ys_ref, dxs_ref = _reference(ref, xs, dys, training)
        runs = {}
        for quantized in (True, False):
            moe = _build(recipe, group, quantized)
            _load_slice(moe, ref, rank, world)
            y, dx = _run_ep(moe, xs[rank], dys[rank], training)
            runs[quantized] = (y, dx, moe)
            what = f"{cfg} quantized_dispatch={quantized}"
            _same(y, ys_ref[rank], f"{what}: y vs EP=1")
            if training:
                e_l = E // world
                _same(dx, dxs_ref[rank], f"{what}: dx vs EP=1")
                for name in ("fc1", "fc2"):
                    dw, dw_ref = getattr(moe, name).weight.grad, getattr(ref, name).weight.grad[rank * e_l:(rank + 1) * e_l]
                    if quantized and (recipe_name, training) in REQUANTIZED:
                        db = sqnr_db(dw_ref.float(), dw.float())
                        floor = REQUANTIZED[(recipe_name, training)]
                        assert db >= floor, f"{what}: {name} dW SQNR {db:.1f} dB vs EP=1 (floor {floor})"
                    else:
                        _same(dw, dw_ref, f"{what}: {name} dW vs EP=1")
        for i, part in enumerate(("y", "dx")[:1 + training]):
            _same(runs[True][i], runs[False][i], f"{cfg}: {part} quantized vs high-precision dispatch")
        wire_q, wire_hp = runs[True][2].wire.bytes, runs[False][2].wire.bytes
        hp_row = H * 2
        want_hp = _expected_dispatch_bytes(ref, xs, rank, world, hp_row)
        assert wire_hp["dispatch"] == want_hp, f"{cfg}: HP dispatch bytes"
        report[(recipe_name, training)] = (wire_q, wire_hp, _expected_dispatch_bytes(ref, xs, rank, world, 1))
    return report


@pytest.mark.parametrize("world", [pytest.param(2, id="EP=2"), pytest.param(4, id="EP=4", marks=slow)])
def test_ep_equals_single_rank_and_counts_bytes(world):
    reports = run_ranks(_worker, world, CONFIGS)
    for rank, rep in enumerate(reports):
        for (recipe_name, training), (wire_q, wire_hp, rows_out) in rep.items():
            cfg = f"EP={world} rank={rank} recipe={recipe_name} training={training}"
            # bytes per token row on the wire in each format (H = 64)
            q_row = {"bf16": 2 * H, "fp8_current": H, "mxfp8": H + H // 32, "nvfp4": 2 * H}
            hp_grad = wire_hp.get("combine_grad", 0)
            if recipe_name == "fp8_current":
                # E4M3 tokens forward, E5M2 gradients backward: 1 byte per element
                assert wire_q["dispatch"] == rows_out * H, cfg
                assert wire_q["combine_grad"] == rows_out * H and hp_grad == rows_out * 2 * H, cfg
                assert wire_q["dispatch_amax"] == E * 4 and wire_q["combine_grad_amax"] == E * 4, cfg
            elif recipe_name == "mxfp8":
                assert wire_q["dispatch"] == rows_out * q_row["mxfp8"], cfg  # E4M3 + E8M0 per 32
                assert wire_q["dispatch"] * 64 == wire_hp["dispatch"] * 33, cfg  # 0.516x bf16
                assert "dispatch_amax" not in wire_q, cfg  # no per-tensor scale: no all-reduce
                if training:  # dy rows likewise
                    assert wire_q["combine_grad"] == rows_out * q_row["mxfp8"] and hp_grad == rows_out * 2 * H, cfg
            elif recipe_name == "mxfp8_fwd_nvfp4_bwd":  # MXFP8 rows; dy (NVFP4 SR) high precision
                assert wire_q["dispatch"] == rows_out * q_row["mxfp8"] and "dispatch_amax" not in wire_q, cfg
                assert wire_q["combine_grad"] == hp_grad == rows_out * 2 * H, cfg
            elif recipe_name == "nvfp4" and not training:
                assert wire_q["dispatch"] == rows_out * (H // 2 + H // 16), cfg  # E2M1 pairs + E4M3 per 16
                assert wire_q["dispatch_amax"] == E * 4, cfg  # the per-expert global scales' amax
            else:  # high precision on the wire (bf16, or a documented fallback)
                assert wire_q["dispatch"] == rows_out * 2 * H, cfg
            assert wire_hp["dispatch"] == rows_out * 2 * H, cfg
            assert wire_q["combine"] == wire_hp["combine"], cfg  # combine forward is always high precision
            assert wire_q["counts"] == (world - 1) * (E // world) * 8, cfg


def _force_packed_path() -> None:
    """In this worker process, the packed grouped path (CUDA's) runs on CPU too (its
    emulated kernels)."""
    from hybrid_dist.moe import grouped_quantized as gq

    gq.fits = lambda plan, x, weight: gq.unsupported_reason(plan, x, weight) is None


def _delayed_worker(rank, world, steps, packed):
    """fp8_delayed over ``steps`` steps (its scales come from the histories from step 2 on):
    quantized and high-precision dispatch both equal EP = 1 bitwise (y, dx, dW), and every
    local expert's input and gradient history and scale equal the EP = 1 expert's; ``packed``
    forces the packed grouped path on CPU (the one CUDA takes). Returns the quantized run's
    wire bytes."""
    if packed:
        _force_packed_path()
    group, e_l = dist.group.WORLD, E // world
    recipe = hd.recipe_from_name("fp8_delayed")
    torch.manual_seed(1234)
    xs = list(torch.randn(world * T, H, dtype=torch.bfloat16).split(T))
    dys = list(torch.randn(world * T, H, dtype=torch.bfloat16).split(T))

    def build(ep_group, quantized):  # no shared expert: its states would run per rank
        torch.manual_seed(0)
        return MoE(H, FFN, E, TOP_K, recipe=recipe, ep_group=ep_group, quantized_dispatch=quantized,
                   dtype=torch.bfloat16)

    ref = build(None, True)
    models = {q: build(group, q) for q in (True, False)}
    with torch.no_grad():
        for m in models.values():
            for name in ("fc1", "fc2"):
                getattr(m, name).weight.copy_(getattr(ref, name).weight[rank * e_l:(rank + 1) * e_l])
            m.router.load_state_dict(ref.router.state_dict())
    for step in range(steps):
        scale = 1.0 + step  # new inputs each step, so the histories move
        xi = [(x * scale).requires_grad_(True) for x in xs]
        routes = [ref.router(x) for x in xi]
        ys_ref = torch.split(ref.routed(torch.cat(xi), torch.cat([r[0] for r in routes]),
                                        torch.cat([r[1] for r in routes])), T)
        torch.cat(ys_ref).backward(torch.cat(dys))
        dxs_ref = [x.grad for x in xi]
        for quantized, moe in models.items():
            what = f"EP={world} rank={rank} fp8_delayed step={step} quantized_dispatch={quantized}"
            y, dx = _run_ep(moe, xs[rank] * scale, dys[rank], True)
            _same(y, ys_ref[rank], f"{what}: y vs EP=1")
            _same(dx, dxs_ref[rank], f"{what}: dx vs EP=1")
            for name in ("fc1", "fc2"):
                dw_ref = getattr(ref, name).weight.grad[rank * e_l:(rank + 1) * e_l]
                _same(getattr(moe, name).weight.grad, dw_ref, f"{what}: {name} dW vs EP=1")
                for role in ("input", "grad_output"):
                    got, want = getattr(moe, name).plan(recipe).states[role], getattr(ref, name).plan(recipe).states[role]
                    for j, st in enumerate(got):
                        st_ref = want[rank * e_l + j]
                        _same(st.amax_history, st_ref.amax_history, f"{what}: {name} {role} expert {j} history")
                        _same(st.scale.reshape(1), st_ref.scale.reshape(1), f"{what}: {name} {role} expert {j} scale")
            moe.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    return dict(models[True].wire.bytes), _expected_dispatch_bytes(ref, xs, rank, world, 1)


@pytest.mark.parametrize("packed", [False, True], ids=["loop", "packed"])
def test_ep_delayed_scaling_travels_quantized(packed):
    """Delayed scaling's rows travel in FP8 (1 byte per element each way) with the experts'
    scales gathered from their ranks (``E_l`` floats from each other rank per exchange)."""
    world, steps = 2, 3
    for rank, (wire, rows_out) in enumerate(run_ranks(_delayed_worker, world, steps, packed)):
        cfg = f"EP={world} rank={rank} fp8_delayed {'packed' if packed else 'loop'} path"
        # the last step's tokens are the first step's times 3: the same experts, the same rows
        assert wire["dispatch"] == steps * rows_out * H and wire["combine_grad"] == steps * rows_out * H, (cfg, wire)
        assert wire["dispatch_scale"] == steps * (E // world) * 4 * (world - 1), (cfg, wire)
        assert wire["dispatch_amax"] == steps * E * 4, (cfg, wire)


# recipe -> the receiver's packing function
PACKED = {"fp8_current": "packed_fp8_rows", "fp8_delayed": "packed_fp8_rows", "mxfp8": "place_rows",
          "mxfp8_fwd_nvfp4_bwd": "place_rows"}
PACKED_DW_FLOOR = {"mxfp8": DW_SQNR_FLOOR_DB, "mxfp8_fwd_nvfp4_bwd": NVFP4_FLOOR}  # requantized columnwise


def _count_index_builds() -> list:
    """In this worker process, every packed index built (``moe.packed_index``), appended to
    the returned list."""
    import hybrid_dist.moe.device_split as ds
    import hybrid_dist.moe.packed_index as pi
    import hybrid_dist.moe.route as route_mod

    builds, real = [], pi.packed_index

    def counted(*a):
        builds.append(a[2])
        return real(*a)

    pi.packed_index = ds.packed_index = route_mod.packed_index = counted
    return builds


def _packed_worker(rank, world, recipe_name):
    """``recipe_name`` with the packed grouped path forced on CPU (its emulated kernels): the
    quantized dispatch hands the received rows over packed (``io["x_packed"]`` /
    ``"dy_packed"``) and equals the high-precision dispatch: bitwise for per-tensor FP8;
    for ``mxfp8`` and ``mxfp8_fwd_nvfp4_bwd`` y and dx bitwise and the experts' weight
    gradients within the SQNR floor (the receiver requantizes the columnwise direction).
    Returns failures."""
    import hybrid_dist.moe.device_split as ds

    _force_packed_path()
    calls, fn = [], PACKED[recipe_name]
    place = getattr(ds, fn)
    setattr(ds, fn, lambda *a, **k: calls.append(1) or place(*a, **k))
    builds = _count_index_builds()
    import hybrid_dist.moe.grouped_linear as gl

    checks, check = [], gl.check_token_counts
    gl.check_token_counts = lambda *a: checks.append(1) or check(*a)
    torch.manual_seed(1234)
    xs = list(torch.randn(world * T, H, dtype=torch.bfloat16).split(T))
    dys = list(torch.randn(world * T, H, dtype=torch.bfloat16).split(T))
    recipe = hd.recipe_from_name(recipe_name)
    ref = _build(recipe, None, True)
    runs, cfg, bad = {}, f"EP={world} rank={rank} {recipe_name} packed path", []
    for quantized in (True, False):
        moe = _build(recipe, dist.group.WORLD, quantized)
        _load_slice(moe, ref, rank, world)
        n0, b0, c0 = len(calls), len(builds), len(checks)
        y, dx = _run_ep(moe, xs[rank], dys[rank], True)
        runs[quantized] = (y, dx, moe.fc1.weight.grad, moe.fc2.weight.grad, len(calls) - n0, dict(moe.wire.bytes),
                           len(builds) - b0, len(checks) - c0)
    hp_dy = recipe_name == "mxfp8_fwd_nvfp4_bwd"  # its dy (NVFP4 SR) travels high precision
    # packed indexes built in the step: the route's two (its slots, its regroup blocks), then
    # the received rows' one index shared by the dispatch, both experts' splits and the
    # combine's gradient; where dy travels high precision fc2 splits h and dy without the
    # route's index. HP dispatch: every split its own
    want_builds = (3 + 2 * hp_dy, 6)
    if (runs[True][6], runs[False][6]) != want_builds:
        bad.append(f"{cfg}: packed index builds {runs[True][6]} / {runs[False][6]} (expected {want_builds})")
    # GroupedLinear checks the counts on the device unless its io carries the route's index
    want_checks = (1 if hp_dy else 0, 2)  # fc2's io is None where dy travels high precision
    if (runs[True][7], runs[False][7]) != want_checks:
        bad.append(f"{cfg}: GroupedLinear count checks {runs[True][7]} / {runs[False][7]} (expected {want_checks})")
    if (runs[True][4], runs[False][4]) != (1 if hp_dy else 2, 0):
        bad.append(f"{cfg}: {fn} calls {runs[True][4]} / {runs[False][4]} (expected {1 if hp_dy else 2} / 0)")
    requantized = recipe_name in PACKED_DW_FLOOR
    for i, name in enumerate(("y", "dx", "fc1.weight.grad", "fc2.weight.grad")):
        what = f"{cfg}: {name}, quantized vs high-precision dispatch"
        if requantized and name.endswith("weight.grad"):
            db, floor = sqnr_db(runs[False][i].float(), runs[True][i].float()), PACKED_DW_FLOOR[recipe_name]
            if db < floor:
                bad.append(f"{what}: SQNR {db:.1f} dB < {floor}")
            continue
        try:
            _same(runs[True][i], runs[False][i], what)
        except AssertionError as e:
            bad.append(str(e))
    q, hp = runs[True][5], runs[False][5]
    row_bytes = H + H // 32 if requantized else H  # MXFP8: codes and E8M0 scales; FP8: codes
    dy_bytes = 2 * H if hp_dy else row_bytes
    if not (q["dispatch"] * 2 * H == hp["dispatch"] * row_bytes and q["combine_grad"] * 2 * H
            == hp["combine_grad"] * dy_bytes):
        bad.append(f"{cfg}: bytes ({row_bytes} per row against bf16's {2 * H}) {q} vs {hp}")
    return bad


@pytest.mark.parametrize("recipe_name", sorted(PACKED))
def test_packed_quantized_dispatch_equals_hp_dispatch(recipe_name):
    bad = [b for per_rank in run_ranks(_packed_worker, 2, recipe_name) for b in per_rank]
    assert not bad, "\n".join(bad)


def _cuda_step(quantized, recipe_name="fp8_current"):
    h, ffn, e, top_k, t = 256, 256, 4, 2, 512
    torch.manual_seed(0)
    moe = MoE(h, ffn, e, top_k, recipe=hd.recipe_from_name(recipe_name), ep_group=dist.group.WORLD,
              quantized_dispatch=quantized, device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(True)
    dy = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    y, aux = moe(x)
    (y.float() * dy.float()).sum().add(aux).backward()
    grads = {n: p.grad for n, p in moe.named_parameters()}
    return {"y": y.detach(), "dx": x.grad, **grads}


def _cuda_packed_compare(rank, world, recipe_name):
    import hybrid_dist.moe.device_split as ds

    calls = []
    place = ds.packed_fp8_rows
    ds.packed_fp8_rows = lambda *a, **k: calls.append(1) or place(*a, **k)
    quantized = _cuda_step(True, recipe_name)
    n_packed = len(calls)
    hp = _cuda_step(False, recipe_name)
    differ = {k: int((_bits(quantized[k]) != _bits(hp[k])).sum()) for k in hp}
    return n_packed, differ


@pytest.mark.gpu
@pytest.mark.parametrize("recipe_name", ["fp8_current", "fp8_delayed"])
def test_ep1_packed_quantized_dispatch_is_bitwise_the_hp_dispatch(recipe_name):
    """One NCCL rank, per-tensor FP8: the received FP8 rows go straight into the packed
    grouped GEMMs (``device_split.packed_fp8_rows``: ``io["x_packed"]`` in the forward,
    ``io["dy_packed"]`` in the backward), and the output and every gradient are bitwise
    those of the high-precision dispatch (which quantizes after the exchange on the same
    packed path)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ((n_packed, differ),) = run_nccl(_cuda_packed_compare, 1, recipe_name)
    where = f"EP=1 {recipe_name}"
    assert n_packed == 2, f"{where}: packed_fp8_rows ran {n_packed} times (dispatch fwd + combine bwd: 2)"
    assert not any(differ.values()), f"{where}, quantized vs high-precision dispatch: elements differ {differ}"


def _cuda_requantized_compare(rank, world, recipe_name):
    quantized, hp = _cuda_step(True, recipe_name), _cuda_step(False, recipe_name)
    differ = {k: int((_bits(quantized[k]) != _bits(hp[k])).sum()) for k in hp}
    sqnr = {k: sqnr_db(hp[k].float(), quantized[k].float()) for k in hp}
    return differ, sqnr


@pytest.mark.gpu
@pytest.mark.parametrize("recipe_name", sorted(PACKED_DW_FLOOR))
def test_ep1_requantized_training_dispatch_on_cuda(recipe_name):
    """One NCCL rank, ``mxfp8`` and ``mxfp8_fwd_nvfp4_bwd`` training: MXFP8 rows on the
    wire, the columnwise (MXFP8; NVFP4 with RHT) quantized at the receiver. y, dx and every
    gradient but the experts' weights bitwise the high-precision dispatch; the experts'
    weight gradients within the recipe's SQNR floor."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ((differ, sqnr),) = run_nccl(_cuda_requantized_compare, 1, recipe_name)
    wgrads = {"fc1.weight", "fc2.weight"}
    floor = PACKED_DW_FLOOR[recipe_name]
    assert not any(n for k, n in differ.items() if k not in wgrads), f"EP=1 {recipe_name}: elements differ {differ}"
    low = {k: sqnr[k] for k in wgrads if sqnr[k] < floor}
    assert not low, f"EP=1 {recipe_name}: weight-gradient SQNR (dB) below {floor}: {low}"
