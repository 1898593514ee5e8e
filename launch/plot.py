"""``python -m hybrid_dist.launch.plot RUN.jsonl [RUN.jsonl ...] --out runs.png``

Reads metrics JSONL files written by ``launch.train --metrics`` and writes one PNG with
two panels: loss against step for every run (with the synthetic data's entropy floor
when known), and a bar chart of each run's mean tokens/s (first step excluded). Runs
with ``--inspect-every`` statistics get a heatmap each below (modules × operand
directions at the last inspect step, or ``--inspect-step``), coloured by ``--stat``
(``sqnr`` or ``underflow``) of the format used, or of candidate ``--format``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from hybrid_dist.launch.inspect_records import load_inspect, module_order
from hybrid_dist.launch.plot_inspect import STATS, draw_heatmap


def load_run(path: str) -> dict:
    """``{"name", "steps", "losses", "tokens_per_s", "entropy_floor"}`` of the last run in ``path``.
    A resumed run's ``start`` record (``start_step`` N > 0) replaces the steps after N that
    the earlier run logged (those it ran again), so each step appears once."""
    start, steps = None, []
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("event") == "start" and rec.get("start_step", 0) == 0:
                start, steps = rec, []  # a fresh run replaces earlier ones appended to the file
            elif rec.get("event") == "start":
                start = start or rec
                steps = [r for r in steps if r["step"] <= rec["start_step"]]
            elif rec.get("event") == "step":
                steps.append(rec)
    if not steps:
        raise ValueError(f"{path}: no step records; pass a metrics file written by launch.train --metrics")
    from hybrid_dist.launch.metrics import timed_tokens_per_s

    return {"name": (start or {}).get("name") or os.path.basename(path),
            "steps": [r["step"] for r in steps], "losses": [r["loss"] for r in steps],
            "tokens_per_s": timed_tokens_per_s(steps, (start or {}).get("timing_warmup", 1)),
            "entropy_floor": (start or {}).get("entropy_floor")}


def _inspect_panels(paths: list[str], step: int | None) -> list[tuple[str, int, list[dict]]]:
    """``(run name, step, records)`` of the chosen inspect step of each run that has one."""
    out = []
    for p in paths:
        start, events = load_inspect(p)
        if step is not None:
            events = [e for e in events if e["step"] == step]
        if events:
            out.append((start.get("name") or os.path.basename(p), events[-1]["step"], events[-1]["records"]))
    return out


def plot(paths: list[str], out: str, *, title: str | None = None, stat: str = "sqnr", fmt: str | None = None,
         inspect_step: int | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg", force=False)  # a file backend; no display needed
    import matplotlib.pyplot as plt

    runs = [load_run(p) for p in paths]
    panels = _inspect_panels(paths, inspect_step)
    n_mod = max([len(module_order(r)) for _, _, r in panels] or [0])
    fig = plt.figure(figsize=(12, 4.5 + (len(panels) and max(4.0, 0.16 * n_mod)) * len(panels)))
    heights = [4.5] + [max(4.0, 0.16 * n_mod)] * len(panels)
    gs = fig.add_gridspec(1 + len(panels), 2, width_ratios=[2, 1], height_ratios=heights)
    ax_loss, ax_tps = fig.add_subplot(gs[0, 0]), fig.add_subplot(gs[0, 1])
    for r in runs:
        ax_loss.plot(r["steps"], r["losses"], label=r["name"], linewidth=1.2)
    floors = {r["entropy_floor"] for r in runs if isinstance(r["entropy_floor"], float)
              and math.isfinite(r["entropy_floor"])}
    if len(floors) == 1:
        ax_loss.axhline(floors.pop(), color="gray", linestyle="--", linewidth=1, label="data entropy floor")
    ax_loss.set(xlabel="step", ylabel="loss (nats/token)", title=title or "training loss")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend(fontsize=8)
    names = [r["name"] for r in runs]
    ax_tps.bar(range(len(runs)), [r["tokens_per_s"] for r in runs], color="tab:blue")
    ax_tps.set_xticks(range(len(runs)), names, rotation=30, ha="right", fontsize=8)
    ax_tps.set(ylabel="tokens/s (all ranks)", title="throughput")
    for i, (name, step, records) in enumerate(panels):
        ax = fig.add_subplot(gs[1 + i, :])
        im = draw_heatmap(ax, records, stat=stat, fmt=fmt, title=f"{name}, step {step}")
        fig.colorbar(im, ax=ax, fraction=0.03)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hybrid_dist.launch.plot", description=__doc__.split("\n\n")[1])
    p.add_argument("runs", nargs="+", help="metrics JSONL files")
    p.add_argument("--out", required=True, help="PNG path to write")
    p.add_argument("--title", default=None)
    p.add_argument("--stat", choices=sorted(STATS), default="sqnr", help="heatmap colour (runs with statistics)")
    p.add_argument("--format", default=None, dest="fmt",
                   help="heatmap of this format label (e.g. mxfp8, nvfp4) instead of the one used")
    p.add_argument("--inspect-step", type=int, default=None, help="heatmap of this inspect step (default: last)")
    args = p.parse_args(argv)
    print(plot(args.runs, args.out, title=args.title, stat=args.stat, fmt=args.fmt, inspect_step=args.inspect_step))
    return 0


if __name__ == "__main__":
    sys.exit(main())
