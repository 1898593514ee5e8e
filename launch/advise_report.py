"""What ``launch.advise`` writes: the recipe module (loadable with ``--recipe PATH:recipe``),
a text report and a one-page PNG of the choices and the evidence."""

from __future__ import annotations

import dataclasses
import math

from hybrid_dist.inspection import CANDIDATES
from hybrid_dist.launch.advice import HIGH, ORDER, Cell, plan_of
from hybrid_dist.launch.inspect_records import COLUMN_LABELS, COLUMNS, module_order


def quantizer_source(q) -> str:
    """``hd.NVFP4Quantizer(rht=True)``: a quantizer as source, non-default fields only."""
    args = [f"{f.name}={getattr(q, f.name)!r}" for f in dataclasses.fields(q)
            if f.init and getattr(q, f.name) != f.default]
    return f"hd.{type(q).__name__}({', '.join(args)})"


def recipe_source(cells: list[Cell], *, name: str, source: str, min_sqnr: float, max_underflow: float) -> str:
    """A Python module defining ``recipe`` (an ``hd.CustomRecipe``) for the choices."""
    plan = plan_of(cells)
    qs = {f"{c}_{t}": CANDIDATES[c][t] for c in ORDER for t in ("input", "weight", "grad_output")}
    lines = [
        f'"""Per-layer hybrid recipe proposed by ``python -m hybrid_dist.launch.advise`` from {source}',
        f"(min SQNR {min_sqnr:g} dB, max underflow {max_underflow:g}). Use it with",
        "``--recipe THIS_FILE.py:recipe``. Modules or operands not listed run in high precision.",
        '"""',
        "",
        "import torch  # noqa: F401  (dtypes in the quantizer arguments)",
        "",
        "import hybrid_dist as hd",
        "",
        "HIGH = hd.IdentityQuantizer()",
        "CANDIDATES = {",
        *(f"    {k!r}: {quantizer_source(q)}," for k, q in qs.items()),
        "}",
        "",
        "# (module, tensor type) -> (rowwise format, columnwise format)",
        "PLAN = {",
        *(f"    {k!r}: {v!r}," for k, v in plan.items()),
        "}",
        "",
        "",
        "def _direction(choice, tensor_type):",
        f"    return HIGH if choice == {HIGH!r} else CANDIDATES[f\"{{choice}}_{{tensor_type}}\"]",
        "",
        "",
        "def factory(role):",
        f"    row, col = PLAN.get((role.name, role.tensor_type), ({HIGH!r}, {HIGH!r}))",
        "    if row == col:",
        "        return _direction(row, role.tensor_type)",
        "    return hd.HybridQuantizer(rowwise=_direction(row, role.tensor_type),",
        "                              columnwise=_direction(col, role.tensor_type))",
        "",
        "",
        f"recipe = hd.CustomRecipe(factory, name={name!r})",
        "",
    ]
    return "\n".join(lines)


def _db(v) -> str:
    return "n/a" if v is None else "exact" if math.isinf(v) else f"{v:.1f} dB"


def text_report(cells: list[Cell], *, source: str, steps: list[int], min_sqnr: float, max_underflow: float) -> str:
    counts = {k: sum(c.choice == k for c in cells) for k in (*ORDER, HIGH)}
    out = [f"advice for {source} (inspect steps {steps}); thresholds: SQNR >= {min_sqnr:g} dB and "
           f"underflow <= {max_underflow:g} at every step",
           "each cell takes the cheapest candidate that clears both (NVFP4, then MXFP8), else high precision",
           "statistics are of deterministic candidates (no stochastic rounding); the recipe uses exactly them",
           f"choices: {', '.join(f'{k} {v}' for k, v in counts.items())} of {len(cells)} operand directions", ""]
    for c in cells:
        ev = "; ".join(f"{n} {_db(c.worst[n][0])}, underflow "
                       f"{'n/a' if c.worst[n][1] is None else format(c.worst[n][1], '.3%')}" for n in ORDER)
        out.append(f"{c.module:<36s} {c.tensor_type:<11s} {c.direction:<10s} -> {c.choice:<14s} "
                   f"(used {c.used}; worst {ev})")
    return "\n".join(out) + "\n"


def report_png(cells: list[Cell], path: str, *, title: str, min_sqnr: float) -> None:
    """Left: the choice per cell (colour) with the chosen format's worst SQNR; right: the
    worst NVFP4 SQNR (what the cheapest format would lose)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap

    modules = module_order([{"module": c.module} for c in cells])
    names = (*ORDER, HIGH)
    choice = np.full((len(modules), len(COLUMNS)), np.nan)
    nv = np.full_like(choice, np.nan)
    at = {(c.module, c.tensor_type, c.direction): c for c in cells}
    for i, m in enumerate(modules):
        for j, (t, d) in enumerate(COLUMNS):
            c = at.get((m, t, d))
            if c is not None:
                choice[i, j] = names.index(c.choice)
                s = c.worst["nvfp4"][0]
                nv[i, j] = np.nan if s is None else min(s, 60.0)
    h = max(4.0, 0.16 * len(modules) + 1.5)
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(14, h))
    a0.imshow(choice, aspect="auto", cmap=ListedColormap(["tab:red", "tab:orange", "tab:blue"]), vmin=0, vmax=2,
              interpolation="nearest")
    cm = matplotlib.colormaps["viridis"].with_extremes(bad="lightgrey")
    im = a1.imshow(np.ma.masked_invalid(nv), aspect="auto", cmap=cm, interpolation="nearest")
    fig.colorbar(im, ax=a1, fraction=0.03, label="worst NVFP4 SQNR (dB)")
    for ax in (a0, a1):
        ax.set_xticks(range(len(COLUMN_LABELS)), COLUMN_LABELS, fontsize=7)
        ax.set_yticks(range(len(modules)), modules, fontsize=max(4, min(8, int(400 / max(len(modules), 1)))))
    a0.set_title("choice: red NVFP4, orange MXFP8, blue high precision", fontsize=9)
    a1.set_title(f"why: NVFP4 below {min_sqnr:g} dB (grey: no statistics)", fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
