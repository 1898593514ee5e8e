"""Reading the ``inspect`` lines of a metrics JSONL (``--inspect-every``) and arranging
them as a grid: one row per module, one column per operand direction.

The columns follow the three GEMMs of ``y = x Wᵀ``: ``x`` rowwise (fprop), ``x``
columnwise (wgrad), ``W`` rowwise (fprop), ``W`` columnwise (dgrad), ``dy`` rowwise
(dgrad), ``dy`` columnwise (wgrad).
"""

from __future__ import annotations

import json

COLUMNS = (("input", "rowwise"), ("input", "columnwise"), ("weight", "rowwise"), ("weight", "columnwise"),
           ("grad_output", "rowwise"), ("grad_output", "columnwise"))
COLUMN_LABELS = ("x row\nfprop", "x col\nwgrad", "W row\nfprop", "W col\ndgrad", "dy row\ndgrad", "dy col\nwgrad")
RECORD_KEYS = ("module", "tensor_type", "direction", "gemm", "format", "used", "scope", "amax", "sqnr_db",
               "underflow", "saturated", "nonzero", "numel", "scale_hist")


def load_inspect(path: str) -> tuple[dict, list[dict]]:
    """``(start record, inspect events)`` of the last fresh run in ``path`` (as
    ``launch.plot``: a ``start`` with ``start_step`` 0 replaces what came before)."""
    start, events = {}, []
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("event") == "start" and (rec.get("start_step", 0) == 0 or not start):
                start, events = rec, []
            elif rec.get("event") == "inspect":
                events.append(rec)
    return start, events


def module_order(records: list[dict]) -> list[str]:
    """Modules in the order the model ran them (first appearance)."""
    return list(dict.fromkeys(r["module"] for r in records))


def grid(records: list[dict], value: str, *, fmt: str | None = None) -> tuple[list[str], list[list]]:
    """``(modules, rows)``: ``rows[i][j]`` is ``value`` of module ``i`` in column ``j`` for
    the format actually used (``fmt`` None) or for format label ``fmt``; None where absent."""
    modules = module_order(records)
    index = {m: i for i, m in enumerate(modules)}
    cols = {c: j for j, c in enumerate(COLUMNS)}
    rows = [[None] * len(COLUMNS) for _ in modules]
    for r in records:
        if (r["used"] if fmt is None else r["format"] == fmt):
            rows[index[r["module"]]][cols[(r["tensor_type"], r["direction"])]] = r[value]
    return modules, rows
