"""``StatsCollector`` on ``GroupedLinear`` (MoE experts): one row set per module, each row
the experts' ``quant_stats`` combined (``combine_stats``), on every path (the CPU packed
reference, the per-expert loop, and the two CUDA paths: emulated on CPU, and on a GPU);
no extra op when off; no graph break when compiled."""

from __future__ import annotations

import math

import pytest
import torch

import hybrid_dist as hd
from hybrid_dist.formats import Float8Quantizer, MXFP8Quantizer
from hybrid_dist.inspection import CANDIDATES, FIELDS, StatsCollector, combine_stats, decode, quant_stats
from hybrid_dist.moe import GroupedLinear, _grouped_mm, grouped_quantized
from hybrid_dist.moe.split_quantize import split_quantize
from tests.inspection.test_capture import STATS_OPS, _OpLog, rows_clean_and_stale

E, K, N = 4, 64, 96
TOKENS = [10, 0, 17, 13]
EXPERT_OPS = ("hybrid_dist.expert_storage_stats.default", "hybrid_dist.expert_candidate_stats.default")


@pytest.mark.parametrize("q", [Float8Quantizer(), MXFP8Quantizer()], ids=["fp8_per_tensor", "mxfp8"])
def test_combine_equals_stats_of_the_concatenation(q):
    """Row slices of one storage (per-tensor FP8: one shared scale; MXFP8: 1x32 blocks) are
    exact parts, so the combined rows of the parts are the row of the whole: counts and
    amax exactly, norms to fp64 rounding of fp32 partial sums, the histogram exactly for
    blocks (a per-tensor scale is one block per part: the whole's bin, once per part)."""
    torch.manual_seed(0)
    x = torch.randn(96, 64) * torch.logspace(-12, 2, 96)[:, None]  # underflow and a spread of magnitudes
    st, _ = q.quantize_storages(x, rowwise=True, columnwise=False)
    whole = quant_stats(x, st)
    bounds = ((0, 7), (7, 40), (40, 96))
    parts = combine_stats(torch.stack([quant_stats(x[a:b], st.narrow_dim0(a, b - a)) for a, b in bounds]))
    i = {f: n for n, f in enumerate(FIELDS)}
    exact = [i[f] for f in ("amax", "nonzero", "underflow", "saturated", "numel", "sharded")]
    assert torch.equal(parts[exact], whole[exact])
    assert whole[i["underflow"]] > 0 or isinstance(q, MXFP8Quantizer)  # per-tensor FP8 flushes the small rows
    hist = whole[len(FIELDS):] * (len(bounds) if isinstance(q, Float8Quantizer) else 1)
    assert torch.equal(parts[len(FIELDS):], hist)
    for f in ("signal_norm", "noise_norm"):
        assert math.isclose(parts[i[f]], whole[i[f]], rel_tol=1e-6)
    no_ref = combine_stats(torch.stack([quant_stats(None, st), whole]))
    assert math.isnan(no_ref[i["noise_norm"]]) and no_ref[i["numel"]] == 2 * x.numel()
    assert not combine_stats(torch.zeros(0, whole.numel(), dtype=torch.float64)).any()


def _layer(recipe: str) -> GroupedLinear:
    torch.manual_seed(0)
    m = GroupedLinear(E, K, N, name="experts")
    hd.set_recipe(m, hd.recipe_from_name(recipe))
    return m


def _inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(sum(TOKENS), K, generator=g), torch.randn(sum(TOKENS), N, generator=g), torch.tensor(TOKENS)


def _step(m, x, dy, tpe, io=None):
    x = x.clone().requires_grad_(True)
    m(x, tpe, io=io).backward(dy)


def _padded(t: torch.Tensor, multiple: int) -> list[torch.Tensor]:
    out, s = [], 0
    for m in TOKENS:
        p = -(-m // multiple) * multiple
        out.append(torch.cat([t[s:s + m], t.new_zeros(p - m, t.shape[1])]))
        s += m
    return out


def _expected(m, x, dy, tpe) -> dict:
    """The used rows from per-expert storages made again (deterministic recipes), combined."""
    plan = m.plan_for(m.recipe)
    out = {}
    for t, hp in (("input", x), ("grad_output", dy)):
        q = getattr(plan, t)
        g = split_quantize(hp, tpe, [q] * E, rowwise=True, columnwise=True, multiple=plan.multiple)
        for d in ("rowwise", "columnwise"):
            vecs = [quant_stats(xe, st) for xe, st, n in zip(_padded(hp, plan.multiple), g.storages(d), g.padded_splits)
                    if n]
            out[(t, d)] = decode(combine_stats(torch.stack(vecs)).tolist())
    ws = [plan.weight.quantize_storages(w, rowwise=True, columnwise=True) for w in m.weight.detach()]
    for j, d in enumerate(("rowwise", "columnwise")):
        vecs = [quant_stats(w, s[j]) for w, s in zip(m.weight.detach(), ws)]
        out[("weight", d)] = decode(combine_stats(torch.stack(vecs)).tolist())
    return out


@pytest.mark.parametrize("recipe", ["fp8_current", "mxfp8"])
@pytest.mark.parametrize("io", [None, {}], ids=["packed_reference", "per_expert_loop"])
def test_rows_combine_each_experts_gemm_storage(recipe, io):
    """The CPU reference (``io=None``) and the per-expert loop (``io={}``) record the same
    rows: for each operand and direction, every expert's storage against its padded slice,
    combined (every field equal to the recomputation)."""
    m = _layer(recipe)
    x, dy, tpe = _inputs()
    c = StatsCollector(m)
    with c.capture():
        _step(m, x, dy, tpe, io)
    rows = c.read()
    used = {(r["tensor_type"], r["direction"]): r for r in rows if r["used"]}
    assert {r["module"] for r in rows} == {""} and len(used) == 6  # the root module: one row set
    for key, ref in _expected(m, x, dy, tpe).items():
        assert {k: used[key][k] for k in ref} == ref, key
    assert used[("input", "rowwise")]["numel"] == sum(-(-n // m.plan_for(m.recipe).multiple)
                                                      * m.plan_for(m.recipe).multiple for n in TOKENS) * K
    cands = {(r["tensor_type"], r["direction"], r["format"]): r for r in rows if not r["used"]}
    assert ("weight", "rowwise", "nvfp4") in cands
    # a candidate zero-pads each expert's slice to its own blocks (16 token rows for NVFP4's
    # columnwise): the row is every expert's slice padded so, quantized, combined
    q = CANDIDATES["nvfp4"]["input"]
    vecs = [quant_stats(xe, q.quantize_storages(xe, rowwise=False, columnwise=True)[1])
            for xe in _padded(x, math.lcm(m.plan_for(m.recipe).multiple, 16)) if len(xe)]
    ref = decode(combine_stats(torch.stack(vecs)).tolist())
    got = cands[("input", "columnwise", "nvfp4_rht")]
    assert {k: got[k] for k in ref} == ref
    q = CANDIDATES["nvfp4"]["input"]
    vecs = [quant_stats(xe, q.quantize_storages(xe, rowwise=True, columnwise=False)[0])
            for xe in _padded(x, m.plan_for(m.recipe).multiple) if len(xe)]
    ref = decode(combine_stats(torch.stack(vecs)).tolist())
    got = cands[("input", "rowwise", "nvfp4")]
    assert {k: got[k] for k in ref} == ref


def _take_cuda_path(monkeypatch, recipe: str) -> list[int]:
    """Route CPU ``GroupedLinear`` calls down the path ``recipe`` takes on CUDA; the list
    counts the calls that took it."""
    taken = []
    mod, fn = (_grouped_mm, "grouped_mm_linear") if recipe == "bf16" else (grouped_quantized, "grouped_linear")
    inner = getattr(mod, fn)

    def counted(*args, **kwargs):
        taken.append(1)
        return inner(*args, **kwargs)

    monkeypatch.setattr(mod, fn, counted)
    if recipe == "bf16":
        monkeypatch.setattr(_grouped_mm, "fits", lambda plan, a, w: True)
    else:
        monkeypatch.setattr(grouped_quantized, "fits",
                            lambda plan, a, w: grouped_quantized.unsupported_reason(plan, a, w) is None)
    return taken


def _keyed(collector: StatsCollector) -> dict:
    return {(r["tensor_type"], r["direction"], r["format"]): r for r in collector.read()}


@pytest.mark.parametrize("recipe", ["fp8_current", "mxfp8", "bf16"])
def test_cuda_grouped_paths_record_the_reference_rows(recipe, monkeypatch):
    """The sync-free CUDA paths (``grouped_quantized`` for quantized recipes, ``_grouped_mm``
    for bf16; run here on CPU: emulated kernels / CPU ``torch._grouped_mm``) record the rows
    of the CPU reference: weight rows equal; token rows equal but for the zero rows each
    path pads its experts with (``numel`` and the all-zero blocks of the histogram)."""
    x, dy, tpe = (t.bfloat16() if t.is_floating_point() else t for t in _inputs())  # the paths' dtype
    ref_m, m = _layer(recipe).bfloat16(), _layer(recipe).bfloat16()
    cr, cq = StatsCollector(ref_m), StatsCollector(m)
    with cr.capture():
        _step(ref_m, x, dy, tpe)
    taken = _take_cuda_path(monkeypatch, recipe)
    with cq.capture():
        _step(m, x, dy, tpe)
    ref, got = _keyed(cr), _keyed(cq)
    assert taken == [1]
    assert got.keys() == ref.keys() and len(got) >= 6
    for key, r in ref.items():
        g = got[key]
        if key[0] != "weight":  # saturated is a fraction of numel: compare its count
            assert round(g["saturated"] * g["numel"]) == round(r["saturated"] * r["numel"]), key
            g, r = ({k: v for k, v in d.items() if k not in ("numel", "scale_hist", "saturated")} for d in (g, r))
        assert g == r, key


def _ops(m, x, dy, tpe) -> list[str]:
    with _OpLog() as log:
        _step(m, x, dy, tpe)
    return log.ops


@pytest.mark.parametrize("recipe", ["fp8_delayed", "mxfp8_fwd_nvfp4_bwd"])
def test_zero_extra_ops_when_off(recipe):
    x, dy, tpe = _inputs()
    plain, attached = _layer(recipe), _layer(recipe)
    c = StatsCollector(attached)
    _ops(_layer(recipe), x, dy, tpe)  # warm the process-wide caches (Hadamard matrices) before comparing
    base, off = _ops(plain, x, dy, tpe), _ops(attached, x, dy, tpe)
    with c.capture():
        on = _ops(attached, x, dy, tpe)
    assert off == base, f"{len(off)} ops with a collector attached, {len(base)} without"
    # capturing does the work: one operator per row of the layout (every direction is used;
    # a candidate row no expert's padded slice fits stays unwritten)
    n_rows = len(c.modules[0].rows)
    assert 6 <= len(c.read()) <= n_rows
    assert sum(op.startswith(tuple(o.rsplit(".", 1)[0] for o in EXPERT_OPS)) for op in on) == n_rows
    assert not any(op in STATS_OPS for op in on)


def test_compile_fullgraph_with_statistics():
    """``fullgraph=True`` raises on a graph break; the compiled rows equal eager's."""
    torch._dynamo.reset()
    x, dy, tpe = _inputs()
    eager, compiled = _layer("mxfp8"), _layer("mxfp8")
    ce, cc = StatsCollector(eager), StatsCollector(compiled)
    fn = torch.compile(compiled, fullgraph=True, backend="aot_eager")
    with ce.capture():
        _step(eager, x, dy, tpe)
    with cc.capture():
        _step(fn, x, dy, tpe)
    ref, got = ce.read(), cc.read()
    assert len(got) == len(ref) >= 6
    for a, b in zip(ref, got):
        assert {k: a[k] for k in a if k != "sqnr_db"} == {k: b[k] for k in b if k != "sqnr_db"}
        assert a["sqnr_db"] is None or abs(a["sqnr_db"] - b["sqnr_db"]) < 0.01


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8_current", "mxfp8", "bf16"])
def test_cuda_paths_rows_match_the_cpu_reference(recipe):
    """On CUDA (the Triton quantize kernels, ``torch._scaled_grouped_mm`` / ``_grouped_mm``)
    the rows equal the CPU reference's: counts and amax exactly, SQNR within 0.01 dB (token
    rows: counts of the same zero-padded slices, so all but ``numel``/histogram)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x, dy, tpe = (t.bfloat16() if t.is_floating_point() else t for t in _inputs())
    rows = {}
    for device in ("cpu", "cuda"):
        m = _layer(recipe).bfloat16().to(device)
        c = StatsCollector(m)
        with c.capture():
            _step(m, x.to(device), dy.to(device), tpe.to(device))
        rows[device] = _keyed(c)
    ref, got = rows["cpu"], rows["cuda"]
    assert got.keys() == ref.keys() and len(got) >= 6
    for key, r in ref.items():
        g = got[key]
        assert (g["amax"], g["nonzero"]) == (r["amax"], r["nonzero"]), key
        assert round(g["saturated"] * g["numel"]) == round(r["saturated"] * r["numel"]), key
        assert round(g["underflow"] * g["nonzero"]) == round(r["underflow"] * r["nonzero"]), key
        assert (g["sqnr_db"] is None) == (r["sqnr_db"] is None), key
        assert g["sqnr_db"] is None or abs(g["sqnr_db"] - r["sqnr_db"]) < 0.01, key


@pytest.mark.parametrize("path", ["packed_reference", "per_expert_loop", "cuda_path"])
@pytest.mark.parametrize("recipe", ["fp8_current", "mxfp8"])
def test_quantized_weights_columnwise_recorded_from_backward(recipe, path, monkeypatch):
    """A quantized expert weight's columnwise row is recorded from the bytes its dgrad reads
    (valid in backward), not from the forward's (stale under FSDP2): the same rows as a
    step whose buffers stay valid."""
    x, dy, tpe = (t.bfloat16() if t.is_floating_point() else t for t in _inputs())
    r = hd.recipe_from_name(recipe)
    torch.manual_seed(0)
    with hd.quantized_model_init(r):
        m = GroupedLinear(E, K, N, name="experts", recipe=r, dtype=torch.bfloat16)
    if path == "cuda_path":
        _take_cuda_path(monkeypatch, recipe)
    io = {} if path == "per_expert_loop" else None
    rows = rows_clean_and_stale(m, [m.weight], lambda: m(x.clone().requires_grad_(True), tpe, io=io), dy, _keyed)
    assert any(k[:2] == ("weight", "columnwise") for k in rows[0]), f"{recipe}: no weight columnwise row"
    assert rows[1] == rows[0]
