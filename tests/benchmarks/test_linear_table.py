"""``benchmarks.linear``'s table arithmetic (CPU): ratios are medians over rounds of the
ratio within each round, so a drift shared by neighbours in time cancels; a variant that
fails while timed keeps its row."""

from __future__ import annotations

from benchmarks import _bench, linear
from benchmarks.linear import Variant


def _gemms():
    return None


def test_ratios_are_medians_of_per_round_ratios(monkeypatch):
    variants = [Variant("bf16 nn.Linear", _gemms), Variant(linear.TORCHAO, _gemms),
                Variant("fp8_current", _gemms, (_gemms, 0.5)), Variant("mxfp8", None, error="failed: RuntimeError: x")]
    # the GPU slows down by 2x in round 2: per-round ratios stay 2.0 (bf16) and 1.25 (torchao)
    ms = {"bf16 nn.Linear": [8.0, 16.0, 8.0], linear.TORCHAO: [5.0, 10.0, 5.0], "fp8_current": [4.0, 8.0, 4.0],
          "mxfp8": []}
    floors = {"bf16 nn.Linear": [], linear.TORCHAO: [], "fp8_current": [3.0, 6.0, 3.0], "mxfp8": []}
    monkeypatch.setattr(linear, "host_ms", lambda fn: 0.1)  # no GPU; the host time is not checked here
    rows = {r[1]: r for r in linear._shape_rows("m,k,n", variants, ms, floors)}
    assert rows["fp8_current"][2:] == [4.0, 0.1, 2.0, "1.250 [1.250, 1.250]", 8.0 / 3.0, 0.75], rows["fp8_current"]
    assert rows[linear.TORCHAO][4] == 1.6 and rows[linear.TORCHAO][3] == ""  # no host time for torchao
    assert rows["mxfp8"][2].startswith("failed: RuntimeError")


def test_rounds_time_each_variant_and_recipe_gemms_once_per_round(monkeypatch):
    order = []
    gemms = (lambda: order.append("gemms"), 0.25)

    def step(name):
        return lambda: order.append(name)

    def broken():
        raise RuntimeError("out of memory")

    variants = [Variant("a", step("a")), Variant("b", step("b"), gemms), Variant("b graphed", step("bg"), gemms),
                Variant("c", broken), Variant("d", None, error="failed: at build")]
    monkeypatch.setattr(_bench, "bench_ms", lambda fn: fn() or 1.0)
    ms, floors = linear._rounds(variants, 2)
    assert order == ["a", "b", "gemms", "bg"] * 2  # one GEMM timing per recipe and round
    assert ms["b"] == [1.0, 1.0] and floors["b graphed"] == [1.25, 1.25] and ms["c"] == []
    assert variants[3].fn is None and "out of memory" in variants[3].error  # failed in round 1: out of the rounds
