"""``benchmarks.quantize --fast-paths``' table (CPU, a stub timer): medians over rounds, the
speedup as the median of per-round ratios, ``bitwise`` from the outputs' bytes and shapes, and
a case that fails while timed keeps its row."""

from __future__ import annotations

import torch

from benchmarks import quantize


def _out(*values):
    return lambda: (torch.tensor(values, dtype=torch.float32), torch.zeros(0, dtype=torch.uint8))


def test_fast_path_rows_medians_speedups_and_bitwise():
    cases = [("mxfp8", "same bytes", _out(1.0, 2.0), _out(1.0, 2.0)),
             ("nvfp4", "one byte differs", _out(1.0, 2.0), _out(1.0, 3.0)),
             ("nvfp4", "fails", _out(1.0), _out(1.0))]
    seen = []

    def timer(fns, rounds):
        seen.extend(fns)
        ms = {(0, "general"): [2.0, 4.0, 2.0], (0, "fast"): [1.0, 2.0, 1.6],
              (1, "general"): [3.0, 3.0, 3.0], (1, "fast"): [3.0, 6.0, 3.0], (2, "general"): [], (2, "fast"): []}
        return ms, {(2, "fast"): "failed: RuntimeError: boom"}

    rows = quantize.fast_path_rows(cases, 3, timer=timer)
    assert seen == [(0, "general"), (0, "fast"), (1, "general"), (1, "fast"), (2, "general"), (2, "fast")]
    assert rows[0] == ["mxfp8", "same bytes", 2.0, 1.6, 2.0, "yes"], rows[0]
    assert rows[1] == ["nvfp4", "one byte differs", 3.0, 3.0, 1.0, "NO"], rows[1]
    assert rows[2][:3] == ["nvfp4", "fails", "failed: RuntimeError: boom"], rows[2]


def test_a_shape_mismatch_is_not_bitwise():
    cases = [("mxfp8", "shapes", lambda: (torch.zeros(2, 2),), lambda: (torch.zeros(4),))]
    rows = quantize.fast_path_rows(cases, 1, timer=lambda fns, r: ({k: [1.0] for k in fns}, {}))
    assert rows[0][-1] == "NO" and rows[0][4] == 1.0, rows
