"""What statistics cost a training run: ``python -m benchmarks.inspect_cost BASE.jsonl INSPECTED.jsonl``.

Both are ``launch.train --metrics`` files of the same configuration, ``INSPECTED`` with
``--inspect-every N``. The launcher reads losses back at logging steps, so each step record
carries the mean time of its read-back window. Every window of the inspected run after the
first ``timing_warmup`` steps (compilation of both graphs) is compared with the base run's
mean step: the extra time per logging step, and the step-time cost it makes at N and at 100.
"""

from __future__ import annotations

import argparse
import json
import statistics


def _load(path: str):
    start, steps, inspected = {}, {}, set()
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if r.get("event") == "start":
                start = r
            elif r.get("event") == "step":
                steps[r["step"]] = r["step_time_s"]
            elif r.get("event") == "inspect":
                inspected.add(r["step"])
    return start, steps, inspected


def _timed(start: dict, steps: dict) -> dict:
    warm = start.get("timing_warmup", 2)
    return {s: t for s, t in steps.items() if s > warm}


def cost(base_path: str, inspected_path: str) -> dict:
    """``base_ms``, ``extra_ms`` per logging step, ``every`` and the cost fractions."""
    bstart, bsteps, _ = _load(base_path)
    istart, isteps, inspected = _load(inspected_path)
    base = statistics.mean(_timed(bstart, bsteps).values())
    timed = _timed(istart, isteps)
    n_logging = len([s for s in inspected if s in timed])
    if not n_logging:
        raise SystemExit(f"{inspected_path}: no logging step after the warm-up steps")
    extra = (sum(timed.values()) - base * len(timed)) / n_logging
    every = istart.get("inspect_every") or 0
    return {"base_ms": base * 1e3, "extra_ms": extra * 1e3, "logging_steps": n_logging, "every": every,
            "cost_at_every": extra / (every * base) if every else float("nan"), "cost_at_100": extra / (100 * base)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base")
    p.add_argument("inspected")
    args = p.parse_args()
    c = cost(args.base, args.inspected)
    print(f"step {c['base_ms']:.1f} ms without statistics; a logging step costs {c['extra_ms']:.1f} ms more "
          f"({c['logging_steps']} timed); step-time cost at --inspect-every {c['every']}: "
          f"{100 * c['cost_at_every']:.1f}%, at 100: {100 * c['cost_at_100']:.2f}%")


if __name__ == "__main__":
    main()
