"""The advisor's decision: for each module, operand and direction, the cheapest format
whose statistics clear the thresholds at every inspect step of a run.

Candidates, cheapest first: NVFP4, then MXFP8 (``hybrid_dist.inspection.CANDIDATES``:
the quantizers the statistics were measured with, which the proposed recipe uses); else
high precision. A format clears a cell when, at every inspect step, its SQNR is at least
``min_sqnr`` dB and its underflow (fraction of nonzero values flushed to zero) at most
``max_underflow``. A cell with no statistics for a candidate (not recorded: a quantized
parameter without a high-precision twin, a sequence-parallel gathered operand, a shape
that does not fit the format's blocks) cannot choose it.
"""

from __future__ import annotations

import dataclasses
import math

from hybrid_dist.inspection import CANDIDATES, format_label
from hybrid_dist.launch.inspect_records import COLUMNS, module_order

ORDER = ("nvfp4", "mxfp8")  # cheapest first
HIGH = "high_precision"


@dataclasses.dataclass(frozen=True)
class Cell:
    """The choice for one (module, tensor_type, direction) and the evidence for it."""

    module: str
    tensor_type: str
    direction: str
    choice: str                      # a CANDIDATES name or "high_precision"
    worst: dict[str, tuple]          # candidate -> (min SQNR dB or None, max underflow or None), over steps
    used: str | None                 # the format the run used there


def _worst(rows: list[dict]) -> tuple:
    """(min SQNR, max underflow) over ``rows``; an exact quantization (SQNR None with a
    reference) counts as +inf dB; (None, None) when a row has no reference."""
    if not rows or any(r["underflow"] is None for r in rows):
        return None, None
    return min(math.inf if r["sqnr_db"] is None else r["sqnr_db"] for r in rows), max(r["underflow"] for r in rows)


def advise(events: list[dict], *, min_sqnr: float, max_underflow: float = 1.0) -> list[Cell]:
    """One ``Cell`` per (module, column) seen in ``events`` (the run's inspect lines)."""
    records = [r for e in events for r in e["records"]]
    by_key: dict[tuple, list[dict]] = {}
    for r in records:
        by_key.setdefault((r["module"], r["tensor_type"], r["direction"], r["format"]), []).append(r)
    used_fmt = {(r["module"], r["tensor_type"], r["direction"]): r["format"] for r in records if r["used"]}
    cells = []
    for module in module_order(records):
        for tensor_type, direction in COLUMNS:
            worst = {}
            for name in ORDER:
                rows = by_key.get((module, tensor_type, direction,
                                   format_label(CANDIDATES[name][tensor_type], direction)), [])
                worst[name] = _worst(rows)
            choice = next((n for n in ORDER if worst[n][0] is not None and worst[n][0] >= min_sqnr
                           and worst[n][1] <= max_underflow), HIGH)
            cells.append(Cell(module, tensor_type, direction, choice, worst,
                              used_fmt.get((module, tensor_type, direction))))
    return cells


def plan_of(cells: list[Cell]) -> dict[tuple[str, str], tuple[str, str]]:
    """``{(module, tensor_type): (rowwise choice, columnwise choice)}``."""
    out: dict[tuple[str, str], dict[str, str]] = {}
    for c in cells:
        out.setdefault((c.module, c.tensor_type), {"rowwise": HIGH, "columnwise": HIGH})[c.direction] = c.choice
    return {k: (v["rowwise"], v["columnwise"]) for k, v in out.items()}
