"""``benchmarks.linear``'s table arithmetic (CPU): ratios are medians over rounds of the
ratio within each round, so a drift shared by neighbours in time cancels."""

from __future__ import annotations

from benchmarks import linear


def _step():
    return None


def test_ratios_are_medians_of_per_round_ratios(monkeypatch):
    variants = [("bf16 nn.Linear", _step, None), (linear.TORCHAO, _step, None), ("fp8_current", _step, 2.0),
                ("mxfp8", "failed: RuntimeError: x", None)]
    # the GPU slows down by 2x in round 2: per-round ratios stay 2.0 (bf16) and 1.25 (torchao)
    ms = {"bf16 nn.Linear": [8.0, 16.0, 8.0], linear.TORCHAO: [5.0, 10.0, 5.0], "fp8_current": [4.0, 8.0, 4.0]}
    monkeypatch.setattr(linear, "host_ms", lambda fn: 0.1)  # no GPU; the host time is not checked here
    rows = {r[1]: r for r in linear._shape_rows("m,k,n", variants, ms)}
    assert rows["fp8_current"][2:] == [4.0, 0.1, 2.0, 1.25, 4.0, 0.5], rows["fp8_current"]
    assert rows[linear.TORCHAO][4] == 1.6 and rows[linear.TORCHAO][3] == ""  # no host time for torchao
    assert rows["mxfp8"][2].startswith("failed: RuntimeError")


def test_rounds_time_every_variant_once_per_round_in_turn(monkeypatch):
    order = []
    variants = [(name, (lambda n=name: order.append(n)), None) for name in ("a", "b")] + [("c", "failed", None)]
    monkeypatch.setattr(linear, "bench_ms", lambda fn: fn() or 1.0)
    ms = linear._rounds(variants, 3)
    assert order == ["a", "b"] * 3 and ms == {"a": [1.0] * 3, "b": [1.0] * 3}
