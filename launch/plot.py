"""``python -m hybrid_dist.launch.plot RUN.jsonl [RUN.jsonl ...] --out runs.png``

Reads metrics JSONL files written by ``launch.train --metrics`` and writes one PNG with
two panels: loss against step for every run (with the synthetic data's entropy floor
when known), and a bar chart of each run's mean tokens/s (first step excluded).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys


def load_run(path: str) -> dict:
    """``{"name", "steps", "losses", "tokens_per_s", "entropy_floor"}`` of the last run in ``path``."""
    start, steps = None, []
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("event") == "start" and rec.get("start_step", 0) == 0:
                start, steps = rec, []  # a fresh run replaces earlier ones appended to the file
            elif rec.get("event") == "start" and start is None:
                start = rec
            elif rec.get("event") == "step":
                steps.append(rec)
    if not steps:
        raise ValueError(f"{path}: no step records; pass a metrics file written by launch.train --metrics")
    from hybrid_dist.launch.metrics import timed_tokens_per_s

    return {"name": (start or {}).get("name") or os.path.basename(path),
            "steps": [r["step"] for r in steps], "losses": [r["loss"] for r in steps],
            "tokens_per_s": timed_tokens_per_s(steps, (start or {}).get("timing_warmup", 1)),
            "entropy_floor": (start or {}).get("entropy_floor")}


def plot(paths: list[str], out: str, *, title: str | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg", force=False)  # a file backend; no display needed
    import matplotlib.pyplot as plt

    runs = [load_run(p) for p in paths]
    fig, (ax_loss, ax_tps) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [2, 1]})
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
    args = p.parse_args(argv)
    print(plot(args.runs, args.out, title=args.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
