"""``python -m benchmarks.convergence_table conv_<recipe>_s<seed>.jsonl ...``

One table of a multi-seed convergence study: per run, the loss averaged over the 10
steps up to each checkpoint step and over the last 20 steps; then, per recipe, the mean
over seeds and its ratio to bf16's mean (``Δ%`` = how much higher the final loss is).
"""

from __future__ import annotations

import os
import re
import statistics
import sys

from hybrid_dist.launch.plot import load_run


def _mean_upto(steps: list[int], losses: list[float], step: int, n: int = 10) -> float:
    window = [l for s, l in zip(steps, losses) if step - n < s <= step]
    return statistics.fmean(window) if window else float("nan")


def main(paths: list[str]) -> None:
    runs = {}
    for p in paths:
        m = re.match(r"conv_(.+)_s(\d+)\.jsonl$", os.path.basename(p))
        if not m:
            raise ValueError(f"{p}: expected a name conv_<recipe>_s<seed>.jsonl")
        try:
            runs[(m.group(1), int(m.group(2)))] = load_run(p)
        except (ValueError, OSError) as e:
            print(f"(skipped {p}: {e})")
    if not runs:
        return
    last = max(max(r["steps"]) for r in runs.values())
    marks = [s for s in (100, 200, 300, 400, 500, 600, 800, 1000) if s < last] + [last]
    print("| recipe | seed | " + " | ".join(f"step {s}" for s in marks) + " | last-20 mean | steps run |")
    print("|---|---:|" + "---:|" * (len(marks) + 2))
    finals: dict[str, list[float]] = {}
    for (recipe, seed), r in sorted(runs.items()):
        cells = [f"{_mean_upto(r['steps'], r['losses'], s):.3f}" for s in marks]
        tail = statistics.fmean(r["losses"][-20:])
        if max(r["steps"]) == last:
            finals.setdefault(recipe, []).append(tail)
        print(f"| {recipe} | {seed} | " + " | ".join(cells) + f" | {tail:.3f} | {max(r['steps'])} |")
    base = statistics.fmean(finals["bf16"]) if "bf16" in finals else None
    print("\n| recipe | seeds finished | mean last-20 loss | spread (max-min) | vs bf16 |")
    print("|---|---:|---:|---:|---:|")
    for recipe, vals in sorted(finals.items()):
        rel = f"{100 * (statistics.fmean(vals) / base - 1):+.2f}%" if base else "n/a"
        print(f"| {recipe} | {len(vals)} | {statistics.fmean(vals):.3f} | {max(vals) - min(vals):.3f} | {rel} |")


if __name__ == "__main__":
    main(sys.argv[1:])
