"""The statistics panel of ``launch.plot``: a heatmap of one inspect step, modules ×
operand directions, coloured by SQNR (dB) or by the fraction of nonzero values flushed to
zero; cells without a value (not recorded, or exact) are grey and say why."""

from __future__ import annotations

import math

from hybrid_dist.launch.inspect_records import COLUMN_LABELS, grid

STATS = {"sqnr": ("sqnr_db", "SQNR (dB)", "viridis"), "underflow": ("underflow", "underflow (fraction)", "magma_r")}


def draw_heatmap(ax, records: list[dict], *, stat: str, fmt: str | None, title: str):
    """Draw the heatmap on ``ax``; returns the image (for a colour bar)."""
    import numpy as np

    key, label, cmap = STATS[stat]
    modules, rows = grid(records, key, fmt=fmt)
    data = np.array([[math.nan if v is None else float(v) for v in row] for row in rows], dtype=float)
    masked = np.ma.masked_invalid(data)
    import matplotlib

    cm = matplotlib.colormaps[cmap].with_extremes(bad="lightgrey")
    im = ax.imshow(masked, aspect="auto", cmap=cm, interpolation="nearest")
    ax.set_xticks(range(len(COLUMN_LABELS)), COLUMN_LABELS, fontsize=7)
    ax.set_yticks(range(len(modules)), modules, fontsize=max(4, min(8, int(400 / max(len(modules), 1)))))
    small = len(modules) * len(COLUMN_LABELS) <= 120
    for i, row in enumerate(rows):
        for j, v in enumerate(row):
            if v is not None and small:
                ax.text(j, i, f"{v:.1f}" if stat == "sqnr" else f"{v:.2f}", ha="center", va="center", fontsize=6,
                        color="white")
    ax.set_title(f"{title}: {label}, {fmt or 'format used'} (grey: none or exact)", fontsize=9)
    return im
