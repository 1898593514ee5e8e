"""``benchmarks.inspect_cost``: the extra time of a logging step from two metrics files."""

from __future__ import annotations

import json
import math

from benchmarks.inspect_cost import cost


def _write(path, every, times, inspected=()):
    rows = [{"event": "start", "timing_warmup": 2, "inspect_every": every}]
    for step, t in times.items():
        if step in inspected:
            rows.append({"event": "inspect", "step": step, "rank": 0})
        rows.append({"event": "step", "step": step, "step_time_s": t})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_extra_time_per_logging_step(tmp_path):
    """Base 0.4 s/step; the inspected run's timed steps 3-30 average 0.6 s and hold 3
    logging steps: 28 × 0.2 s extra over 3. Steps 1-2 (compilation) are left out."""
    base = _write(tmp_path / "b.jsonl", 0, {s: (9.0 if s <= 2 else 0.4) for s in range(1, 31)})
    times = {s: (9.0 if s <= 2 else 0.6) for s in range(1, 31)}
    insp = _write(tmp_path / "i.jsonl", 10, times, inspected=(1, 10, 20, 30))
    c = cost(base, insp)
    assert c["logging_steps"] == 3 and c["every"] == 10
    assert math.isclose(c["extra_ms"], 28 * 200 / 3, rel_tol=1e-9)  # 28 timed steps, 0.2 s each, over 3
    assert math.isclose(c["cost_at_100"], c["extra_ms"] / 1e3 / (100 * 0.4), rel_tol=1e-9)
