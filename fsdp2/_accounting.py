"""All-gather byte accounting: how many bytes each FSDP2 pass gathered.

``with track_all_gather() as acct:`` records, for every quantized parameter all-gathered
inside the block, the bytes this rank contributed (``input_bytes``) and received
(``output_bytes`` = world size × input), per pass:

* ``"forward"``  — rowwise direction only (``reshard_after_forward=True``);
* ``"backward"`` — columnwise direction only (re-gather after the forward reshard);
* ``"forward_both"`` — both directions once (``reshard_after_forward=False``, the root),
  or the forward of a module whose forward is recomputed in backward;
* ``"recompute_both"`` — both directions in backward for a recomputed module.

``payload_bytes`` excludes the padding of the packed mode (see ``_hooks``). Trackers are
kept in a process-wide list (not a context variable) because FSDP may run the backward
all-gather on an autograd worker thread; nothing is recorded while no tracker is open.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections import defaultdict
from typing import Iterator

PASSES = ("forward", "backward", "forward_both", "recompute_both")


@dataclasses.dataclass
class AllGatherAccounting:
    """Bytes all-gathered per pass (this rank's view)."""

    input_bytes: dict[str, int] = dataclasses.field(default_factory=lambda: defaultdict(int))
    output_bytes: dict[str, int] = dataclasses.field(default_factory=lambda: defaultdict(int))
    payload_bytes: dict[str, int] = dataclasses.field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = dataclasses.field(default_factory=lambda: defaultdict(int))

    def record(self, pass_: str, *, input_bytes: int, payload_bytes: int, world_size: int) -> None:
        self.input_bytes[pass_] += input_bytes
        self.output_bytes[pass_] += input_bytes * world_size
        self.payload_bytes[pass_] += payload_bytes
        self.calls[pass_] += 1

    def total_output_bytes(self) -> int:
        return sum(self.output_bytes.values())

    def reset(self) -> None:
        for d in (self.input_bytes, self.output_bytes, self.payload_bytes, self.calls):
            d.clear()


_LOCK = threading.Lock()
_ACTIVE: list[AllGatherAccounting] = []  # open trackers; hooks add to each


@contextlib.contextmanager
def track_all_gather(acct: AllGatherAccounting | None = None) -> Iterator[AllGatherAccounting]:
    """Record quantized all-gathers inside the block into ``acct`` (a new one by default)."""
    acct = AllGatherAccounting() if acct is None else acct
    with _LOCK:
        _ACTIVE.append(acct)
    try:
        yield acct
    finally:
        with _LOCK:
            _ACTIVE.remove(acct)


def record_all_gather(pass_: str, *, input_bytes: int, payload_bytes: int, world_size: int) -> None:
    with _LOCK:
        for acct in _ACTIVE:
            acct.record(pass_, input_bytes=input_bytes, payload_bytes=payload_bytes, world_size=world_size)
