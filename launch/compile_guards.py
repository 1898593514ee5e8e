"""``--compile-guards steady``: Dynamo's guards of the compiled blocks evaluated on some
steps only.

Before each call of a compiled block Dynamo evaluates its guards: that the inputs, the
module's attributes and the Python objects the trace read are as they were when it
compiled. For a block of ``hd.Linear`` layers with quantized weights that is a larger tree
than for a bf16 block (the plans' quantizer fields, the weights' storage objects, aliasing
and metadata checks per quantized weight): on an H200 host 0.33 ms per block call against
0.12 for bf16, every step, all on the host (one profiled 1b step, 743c428).

The launcher's steps repeat one another: the same token shape, the same modules in
training mode, the same recipes. :class:`SteadyGuards` lets Dynamo evaluate every guard
through the warm-up steps (where it compiles) and on every ``check_every``-th step, and runs
the others under ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``, which skips
the guards of a frame that has one compiled entry (with several, it evaluates only the
guards that tell them apart). That is unsafe if something the guards watch changes on a
skipped step: the step would run the graph compiled for the old state. A check step
evaluates every guard again; if Dynamo compiled anything since the warm-up, some guard
failed, possibly first on a skipped step, and the job stops with an error naming the step
(``--compile-guards full``, the default, never skips).
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["GUARD_MODES", "SteadyGuards", "GuardsChanged"]

GUARD_MODES = ("full", "steady")


class GuardsChanged(RuntimeError):
    """A check step compiled a new graph after the warm-up under ``--compile-guards steady``."""


class SteadyGuards:
    """Which steps skip guard evaluation (``around(step)``) and the check after a step that
    evaluated them (``after_step(step)``). Steps ``start + 1 .. start + warmup`` evaluate
    every guard."""

    def __init__(self, mode: str, *, start: int, warmup: int, check_every: int):
        if mode not in GUARD_MODES:
            raise ValueError(f"compile guards mode must be one of {', '.join(GUARD_MODES)}, got {mode!r}")
        self.steady = mode == "steady"
        self.first_skipped = start + max(warmup, 1) + 1
        self.check_every = max(check_every, 1)
        self.graphs = None  # compiled graphs after the warm-up
        self.skipped_since_check = 0

    def skips(self, step: int) -> bool:
        """True when ``step`` runs without guard evaluation."""
        return self.steady and step >= self.first_skipped and step % self.check_every != 0

    @contextlib.contextmanager
    def around(self, step: int):
        if self.skips(step):
            self.skipped_since_check += 1
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                yield
        else:
            yield

    def after_step(self, step: int, graphs: int | None = None) -> None:
        """After ``step``: record the warm-up's graph count; on a step that evaluated the
        guards, raise :class:`GuardsChanged` if Dynamo compiled since. ``graphs``: the
        count of graphs Dynamo compiled so far (default: read from its counters)."""
        if not self.steady or step < self.first_skipped - 1 or self.skips(step):
            return
        if graphs is None:
            from torch._dynamo.utils import counters

            graphs = int(counters["stats"]["unique_graphs"])
        if self.graphs is None:
            self.graphs = graphs
            return
        if graphs != self.graphs:
            raise GuardsChanged(
                f"--compile-guards steady: Dynamo compiled {graphs - self.graphs} new graph(s) at step {step}, so a "
                f"guard failed there or on one of the {self.skipped_since_check} steps since the last check, "
                "which ran without guards (they may have run a graph compiled for another state). Rerun with "
                "--compile-guards full.")
        self.skipped_since_check = 0
