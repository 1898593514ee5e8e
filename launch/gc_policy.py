"""``--gc-every``: Python's garbage collector on the training job's schedule.

Compiling a model leaves hundreds of thousands of long-lived Python objects (graphs,
guards, generated code, caches; ~530k in a compiled 1b job). Python's automatic collector
scans all of them in every full (generation 2) collection, 0.25–0.32 s on an H200 host,
and starts one whenever enough objects have survived its young generations, in whichever
step that happens: profiled compiled 1b steps showed one such stall of 0.39 s, two to three
steps' worth. Under FSDP a stall on one rank holds up every rank at the next collective.

:class:`StepGC` leaves the collector alone through the warm-up steps (compilation runs with
it), then collects once, freezes every surviving object (``gc.freeze``: live model,
compiler and cache state, which later collections skip), turns automatic collection off and
runs a full collection of the unfrozen rest every ``every`` steps, a few milliseconds.
``every=0`` leaves Python's automatic collector as it is. The launcher owns its process, so
it may set this; the library never touches the collector.
"""

from __future__ import annotations

import gc

__all__ = ["StepGC"]


class StepGC:
    """The collector's schedule for steps ``start + 1 ..``: ``after_step(step)`` after each
    step; ``close()`` restores the collector's state on the way out."""

    def __init__(self, every: int, start: int, warmup: int):
        self.every = every
        self.freeze_at = start + max(warmup, 1)  # compilation and first calls are done by then
        self._was_enabled = gc.isenabled()
        self._frozen = False

    def after_step(self, step: int) -> None:
        if not self.every or step < self.freeze_at:
            return
        if not self._frozen:
            gc.collect()
            gc.freeze()
            gc.disable()
            self._frozen = True
        elif step % self.every == 0:
            gc.collect()

    def close(self) -> None:
        if self._frozen:
            gc.unfreeze()
            if self._was_enabled:
                gc.enable()
            self._frozen = False
