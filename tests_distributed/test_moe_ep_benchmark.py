"""``benchmarks/moe_ep.py`` on 2 gloo ranks at tiny shapes: the table's rows, the same on
every rank, with fewer bytes sent only where the recipe sends quantized payloads."""

from __future__ import annotations

from benchmarks.moe_ep import TINY, run_ep
from tests_distributed._harness import run_ranks


def _rows(rank, world):
    return run_ep(rank, world, ["bf16", "fp8_current", "mxfp8"], TINY, steps=1, warmup=1)


def test_moe_ep_benchmark_rows_on_two_ranks():
    per_rank = run_ranks(_rows, 2)
    assert per_rank[0] == per_rank[1], "every rank must return the same (all-reduced) table"
    rows = {(r[0], r[1]): r for r in per_rank[0]}
    assert list(rows) == [("bf16", "bf16"), ("fp8_current", "quantized"), ("fp8_current", "bf16"),
                          ("mxfp8", "quantized"), ("mxfp8", "bf16")]
    for key, (_, _, ms, x_time, mb, x_bytes) in rows.items():
        assert ms > 0 and x_time > 0 and mb > 0, f"{key}: {rows[key]}"
    # fp8_current sends both payloads in FP8 (1 byte + per-expert scales) instead of bf16
    assert 0.5 < rows[("fp8_current", "quantized")][5] < 0.75, rows[("fp8_current", "quantized")]
    assert rows[("fp8_current", "bf16")][5] == 1.0, rows[("fp8_current", "bf16")]
    # mxfp8 sends x and dy as MXFP8 rows (K + K/32 bytes), the combine forward in bf16; the
    # dispatch backward does not run (x needs no gradient): (2 * 66 + 128) / (3 * 128) plus counts
    assert 0.66 < rows[("mxfp8", "quantized")][5] < 0.70, rows[("mxfp8", "quantized")]
    assert rows[("mxfp8", "bf16")][5] == 1.0, rows[("mxfp8", "bf16")]


def _rows_both_dx(rank, world):
    return run_ep(rank, world, ["bf16", "fp8_current"], TINY, steps=1, warmup=1, dx_exchange=("early", "after"))


def test_moe_ep_benchmark_times_the_dx_exchange_both_ways():
    rows = run_ranks(_rows_both_dx, 2)[0]
    assert [(r[0], r[1]) for r in rows] == [
        ("bf16", "bf16"), ("bf16", "bf16, dx after"), ("fp8_current", "quantized"),
        ("fp8_current", "quantized, dx after"), ("fp8_current", "bf16"), ("fp8_current", "bf16, dx after")]
    # the same exchanges either way: equal bytes on the wire for each recipe and dispatch
    for early, after in zip(rows[0::2], rows[1::2]):
        assert early[4] == after[4] and early[2] > 0 and after[2] > 0, (early, after)
