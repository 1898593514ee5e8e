"""``python -m hybrid_dist.launch.advise RUN.jsonl [--min-sqnr DB] [--out PREFIX]``

Reads the quantization statistics of a run (``launch.train --inspect-every N --metrics
RUN.jsonl``) and proposes a per-layer hybrid recipe: for each module, operand and
direction, NVFP4 or MXFP8 where their statistics clear the thresholds at every inspect
step, else high precision (``launch.advice``). Writes ``PREFIX.py`` (a recipe module:
``--recipe PREFIX.py:recipe``), ``PREFIX.txt`` (the choices and their evidence) and
``PREFIX.png`` (one page: the choices and the NVFP4 SQNR behind them).
"""

from __future__ import annotations

import argparse
import os
import sys

from hybrid_dist.launch.advice import advise
from hybrid_dist.launch.advise_report import recipe_source, report_png, text_report
from hybrid_dist.launch.inspect_records import load_inspect


def run(path: str, *, min_sqnr: float, max_underflow: float, out: str | None = None) -> dict[str, str]:
    """Write the recipe, text and PNG for the run in ``path``; returns their paths."""
    start, events = load_inspect(path)
    if not events:
        raise ValueError(f"{path}: no inspect records; run launch.train with --inspect-every N --metrics {path}")
    cells = advise(events, min_sqnr=min_sqnr, max_underflow=max_underflow)
    prefix = out or os.path.splitext(path)[0] + "_advised"
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    name = f"advised_{start.get('name') or os.path.basename(prefix)}"
    steps = [e["step"] for e in events]
    paths = {"recipe": prefix + ".py", "text": prefix + ".txt", "png": prefix + ".png"}
    with open(paths["recipe"], "w") as f:
        f.write(recipe_source(cells, name=name, source=os.path.basename(path), min_sqnr=min_sqnr,
                              max_underflow=max_underflow))
    with open(paths["text"], "w") as f:
        f.write(text_report(cells, source=path, steps=steps, min_sqnr=min_sqnr, max_underflow=max_underflow))
    report_png(cells, paths["png"], title=f"{name}: SQNR >= {min_sqnr:g} dB, underflow <= {max_underflow:g}",
               min_sqnr=min_sqnr)
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hybrid_dist.launch.advise", description=__doc__.split("\n\n")[1])
    p.add_argument("run", help="metrics JSONL written with --inspect-every")
    p.add_argument("--min-sqnr", type=float, default=20.0, help="lowest SQNR (dB) a format may have (default 20)")
    p.add_argument("--max-underflow", type=float, default=0.1,
                   help="highest fraction of nonzero values it may flush to zero (default 0.1)")
    p.add_argument("--out", default=None, help="path prefix of the outputs (default: RUN_advised)")
    args = p.parse_args(argv)
    try:
        paths = run(args.run, min_sqnr=args.min_sqnr, max_underflow=args.max_underflow, out=args.out)
    except ValueError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    print(open(paths["text"]).read().split("\n\n")[0])
    print(f"wrote {paths['recipe']} (use --recipe {paths['recipe']}:recipe), {paths['text']}, {paths['png']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
