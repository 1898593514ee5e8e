"""``hybrid_dist.library_op``: the operator's schema is inferred from the hints (mutated
inputs annotated), calls dispatch to the function, the fake kernel serves tracing, and a
compiled graph records the op without a graph break."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

from hybrid_dist.library_op import library_op


@library_op("hd_test::scale_add")
def _scale_add(x: torch.Tensor, s: float, twice: bool) -> torch.Tensor:
    return x * s + (x if twice else 0)


@_scale_add.register_fake
def _(x, s, twice):
    return torch.empty_like(x)


@library_op("hd_test::record_max", mutates_args=("out",))
def _record_max(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    out.copy_(torch.maximum(out, x.abs().amax()))
    return x.clone()


@_record_max.register_fake
def _(x, out):
    return torch.empty_like(x)


def test_schema_and_eager_calls():
    assert str(_scale_add.op._schema) == "hd_test::scale_add(Tensor x, float s, bool twice) -> Tensor"
    assert "Tensor(a1!) out" in str(_record_max.op._schema)
    x = torch.arange(4.0)
    assert torch.equal(_scale_add(x, 2.0, True), x * 3) and _scale_add.fn is not None
    out = torch.zeros(())
    _record_max(-x, out)
    assert out.item() == 3.0


def test_compiled_graph_records_the_ops():
    counters.clear()

    def f(x, out):
        y = _scale_add(torch.sin(x), 2.0, False)
        return _record_max(y, out) + 1

    x, out_eager, out_compiled = torch.randn(8), torch.zeros(()), torch.zeros(())
    want = f(x, out_eager)
    got = torch.compile(f, backend="aot_eager", fullgraph=True)(x, out_compiled)
    assert torch.equal(got, want) and torch.equal(out_compiled, out_eager)
    assert not counters["graph_break"], dict(counters["graph_break"])
