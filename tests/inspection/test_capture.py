"""``StatsCollector`` on ``hd.Linear``: the captured rows are the statistics of the tensors
the GEMMs used; outside ``capture()`` the step dispatches exactly the ops of a model
without a collector; under ``torch.compile(fullgraph=True)`` capturing traces (no graph
break), gives the eager statistics, and adds one opaque operator per row to the graph (and
the writes into the buffers), nothing for Inductor to generate code for."""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch
from torch._dynamo.testing import AotEagerAndRecordGraphs
from torch.utils._python_dispatch import TorchDispatchMode

import hybrid_dist as hd
from hybrid_dist.inspection import StatsCollector, decode, quant_stats
from hybrid_dist.inspection import collector as collector_module


def _model(recipe: str):
    torch.manual_seed(0)
    m = torch.nn.Sequential(hd.Linear(64, 96, bias=False, name="up"), torch.nn.ReLU(),
                            hd.Linear(96, 64, bias=False, name="down"))
    hd.set_recipe(m, hd.recipe_from_name(recipe))
    return m


def _inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)


def _step(m, x, g):
    x = x.clone().requires_grad_(True)
    y = m(x)
    y.backward(g)
    return y


def rows_clean_and_stale(model, weights, forward, dy, key) -> list[dict]:
    """``key(collector)`` of one captured step of ``forward().backward(dy)`` on ``model``,
    then of the same step with the quantized ``weights``' columnwise buffers holding 0xFF
    bytes (NaN) through the forward and refilled before the backward, as under FSDP2 in a
    block that reshards after forward (``fsdp2/_hooks.py`` note). Per-tensor scales are
    the shard's own: left as they are."""
    cols = [w.storage_of("columnwise") for w in weights]
    valid = [{f: t.clone() for f, t in col.tensors().items() if t.dim()} for col in cols]

    def write(stale: bool) -> None:
        with torch.no_grad():
            for col, fields in zip(cols, valid):
                for f, v in fields.items():
                    t = getattr(col, f)
                    with torch.autograd._unsafe_preserve_version_counter(t):
                        t.view(torch.uint8).fill_(0xFF) if stale else t.copy_(v)

    rows = []
    for stale in (False, True):
        c = StatsCollector(model)
        with c.capture():
            write(stale)
            y = forward()
            write(False)
            y.backward(dy)
        rows.append(key(c))
    return rows


def test_quantized_weights_columnwise_recorded_from_backward():
    """A quantized weight's columnwise row is recorded from the bytes its dgrad reads (valid
    in backward), not from the forward's (stale under FSDP2): the same rows as a step whose
    buffers stay valid."""
    recipe = hd.recipe_from_name("fp8_current")
    torch.manual_seed(0)
    with hd.quantized_model_init(recipe):
        m = torch.nn.Sequential(hd.Linear(64, 96, bias=False, name="up"), torch.nn.ReLU(),
                                hd.Linear(96, 64, bias=False, name="down"))
    hd.set_recipe(m, recipe)
    x, g = _inputs()
    rows = rows_clean_and_stale(m, [m[0].weight, m[2].weight], lambda: m(x.clone().requires_grad_(True)), g,
                                lambda c: {(r["module"], r["tensor_type"], r["direction"], r["format"]): r
                                           for r in c.read()})
    assert sum(k[1:3] == ("weight", "columnwise") for k in rows[0]) >= 2
    assert rows[1] == rows[0]


def test_used_rows_are_the_gemm_operands():
    """fp8_current is deterministic: quantizing the same tensors again gives the GEMM's
    storages, so each used row equals quant_stats of them (every field)."""
    m = _model("fp8_current")
    x, g = _inputs()
    c = StatsCollector(m)
    with c.capture():
        _step(m, x, g)
    rows = {(r["module"], r["tensor_type"], r["direction"], r["format"]): r for r in c.read()}
    down = m[2]
    plan = down.plan_for(down.recipe)
    h = torch.relu(m[0](x)).detach()  # the input of "down"
    for tensor_type, hp, fmt in (("input", h, "fp8_e4m3"), ("weight", down.weight.detach(), "fp8_e4m3"),
                                 ("grad_output", g, "fp8_e5m2")):
        q = getattr(plan, tensor_type)
        row, col = q.quantize_storages(hp, rowwise=True, columnwise=True)
        for direction, st in (("rowwise", row), ("columnwise", col)):
            rec = rows[("2", tensor_type, direction, fmt)]
            ref = decode(quant_stats(hp, st).tolist())
            assert rec["used"] and {k: rec[k] for k in ref} == ref, (tensor_type, direction)
    # both modules, all three operands, both directions, the used format and two candidates
    assert len(rows) == 2 * 6 * 3
    assert {r["gemm"] for r in rows.values()} == {"fprop", "dgrad", "wgrad"}


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _ops(m, x, g) -> list[str]:
    with _OpLog() as log:
        _step(m, x, g)
    return log.ops


@pytest.mark.parametrize("recipe", ["fp8_delayed", "mxfp8_fwd_nvfp4_bwd"])
def test_zero_extra_ops_when_off(recipe):
    x, g = _inputs()
    plain, attached = _model(recipe), _model(recipe)
    c = StatsCollector(attached)
    _ops(_model(recipe), x, g)  # warm the process-wide caches (Hadamard matrices) before comparing
    base = _ops(plain, x, g)
    off = _ops(attached, x, g)
    with c.capture():
        on = _ops(attached, x, g)
    assert off == base, f"{len(off)} ops with a collector attached, {len(base)} without"
    # 6 (operand, direction) pairs x (used + candidates whose format differs), 2 modules
    n_rows = 2 * {"fp8_delayed": 18, "mxfp8_fwd_nvfp4_bwd": 14}[recipe]
    assert len(c.read()) == n_rows
    # capturing does the work (so the comparison can fail): one statistics operator per row
    stats_ops = [op for op in on if op.startswith(("hybrid_dist.storage_stats", "hybrid_dist.candidate_stats"))]
    assert len(stats_ops) == n_rows


# torch 2.11's compiled backward drops the grad_output rows' buffer writes (the collector warns)
NEEDS_2_13 = pytest.mark.skipif(collector_module._COMPILED_BACKWARD_DROPS_WRITES,
                                reason="compiled backward statistics need torch >= 2.13")


@NEEDS_2_13
def test_compile_fullgraph_with_statistics():
    """``fullgraph=True`` raises on a graph break; the captured rows equal eager's (amax and
    counts exactly, SQNR within 0.01 dB)."""
    torch._dynamo.reset()
    x, g = _inputs()
    eager, compiled = _model("mxfp8"), _model("mxfp8")
    ce, cc = StatsCollector(eager), StatsCollector(compiled)
    fn = torch.compile(compiled, fullgraph=True, backend="aot_eager")
    with ce.capture():
        _step(eager, x, g)
    with cc.capture():
        _step(fn, x, g)
    ref, got = ce.read(), cc.read()
    for m in cc.modules:
        m.reset()
    _step(fn, x, g)  # a step without statistics: the other graph, which writes nothing
    assert all(not m.buf.any() for m in cc.modules)
    assert len(got) == len(ref) > 0
    for a, b in zip(ref, got):
        assert {k: a[k] for k in a if k != "sqnr_db"} == {k: b[k] for k in b if k != "sqnr_db"}
        assert (a["sqnr_db"] is None) == (b["sqnr_db"] is None)
        if a["sqnr_db"] is not None:
            assert abs(a["sqnr_db"] - b["sqnr_db"]) < 0.01
    from torch._dynamo.utils import counters
    assert sum(counters["graph_break"].values()) == 0


STATS_OPS = ("hybrid_dist.storage_stats.default", "hybrid_dist.candidate_stats.default")
BUFFER_WRITES = ("aten.select.int", "aten.select_scatter.default", "aten.copy.default", "aten.copy_.default",
                 "aten._to_copy.default")


def _compiled_ops(capture: bool) -> tuple[collections.Counter, int]:
    """Ops of the compiled forward and backward graphs of one step, and the rows written."""
    torch._dynamo.reset()
    backend = AotEagerAndRecordGraphs()
    m = _model("mxfp8_fwd_nvfp4_bwd")
    c = StatsCollector(m)
    fn = torch.compile(m, fullgraph=True, backend=backend)
    x, g = _inputs()
    with c.capture() if capture else contextlib.nullcontext():
        _step(fn, x, g)
    ops = collections.Counter(str(n.target) for gm in backend.fw_graphs + backend.bw_graphs
                              for n in gm.graph.nodes if n.op == "call_function")
    return ops, len(c.read()) if capture else 0


@NEEDS_2_13
def test_compiled_statistics_are_one_operator_per_row():
    """The graph with statistics has one ``storage_stats`` / ``candidate_stats`` call per row
    and otherwise only the buffer writes beyond the graph without: no reduction of theirs is
    traced (it would be Inductor's to compile, for a graph that runs once every N steps)."""
    (off, _), (on, rows) = _compiled_ops(False), _compiled_ops(True)
    assert rows == 2 * 14
    assert sum(on[op] for op in STATS_OPS) == rows
    extra = {op: on[op] - off[op] for op in on if on[op] > off[op] and op not in STATS_OPS + BUFFER_WRITES}
    assert not extra, f"ops the statistics added to the compiled graph: {extra}"


def test_collector_warns_where_compiled_backward_rows_are_dropped(monkeypatch):
    """On a torch whose compiled backward drops the statistics writes, a collector over a
    model with compiled modules says so; over an eager model it says nothing."""
    import warnings

    from hybrid_dist import warn

    monkeypatch.setattr(collector_module, "_COMPILED_BACKWARD_DROPS_WRITES", True)
    monkeypatch.setattr(warn, "_WARNED", set())
    with warnings.catch_warnings(record=True) as eager:
        warnings.simplefilter("always")
        StatsCollector(_model("fp8_current"))
    model = _model("fp8_current")
    model[0] = torch.compile(model[0], backend="eager")
    with warnings.catch_warnings(record=True) as compiled:
        warnings.simplefilter("always")
        StatsCollector(model)
    assert not [w for w in eager if "statistics" in str(w.message)]
    assert any("grad_output rows of compiled steps" in str(w.message) for w in compiled)
