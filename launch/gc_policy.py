"""``--gc-every``: Python's garbage collector on the training job's schedule.

Compiling a model leaves hundreds of thousands of long-lived Python objects (graphs,
guards, generated code, caches). Python's automatic collector scans all of them in every
full (generation 2) collection, which it starts whenever enough objects have survived the
young generations: on an H200 host such a collection of a compiled 1b stack stalls the
step it lands in by ~0.4 s (a few steps' worth), at a point no one chose.

:class:`StepGC` turns the automatic collector off for the training loop, freezes every
object alive at the end of the warm-up steps (``gc.freeze``: later collections skip them;
they are live model, compiler and cache state), and runs a full collection of the rest
every ``every`` steps, where it costs a few milliseconds. ``every=0`` leaves Python's
automatic collector as it is. The launcher owns its process, so it may set this; the
library never touches the collector.
"""

from __future__ import annotations

import gc
import time

__all__ = ["StepGC"]


class StepGC:
    """The collector's schedule for steps ``start + 1 ..``: ``after_step(step)`` after each
    step; ``close()`` restores the collector's state on the way out."""

    def __init__(self, every: int, start: int, warmup: int):
        self.every = every
        self.freeze_until = start + max(warmup, 1)  # compilation and first calls are done by then
        self.seconds = 0.0  # spent in this schedule's collections after the warm-up
        self._was_enabled = gc.isenabled()
        if every:
            gc.disable()

    def after_step(self, step: int) -> None:
        if not self.every:
            return
        if step <= self.freeze_until:
            gc.collect()
            gc.freeze()
            return
        if step % self.every == 0:
            t0 = time.perf_counter()
            gc.collect()
            self.seconds += time.perf_counter() - t0

    def close(self) -> None:
        if self.every:
            gc.unfreeze()
            if self._was_enabled:
                gc.enable()
