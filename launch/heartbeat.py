"""Collective timeouts of a training job, and which rank fell behind when one fires.

* The process group starts with ``--first-step-timeout`` (setup, compilation, a checkpoint
  load and the first step can be slow on some ranks); once every rank has finished the
  first step, ``shorten_timeouts`` sets ``--collective-timeout`` on every process group.
* ``Heartbeat``: each rank records the last step it finished in the job's store (one small
  ``set`` per step). When a collective times out, ``timeout_message`` names the ranks that
  are behind by those records; when every rank had finished the previous step, each rank
  whose collective timed out reports it in the store, and the ranks that do not report
  within a grace period are named: they are the frozen or lost ones (the others were
  waiting on them).
"""

from __future__ import annotations

import datetime
import os
import time

import torch.distributed as dist

# keys of this attempt (a restarted job shares torchrun's store with the attempts before it)
_PREFIX = f"hybrid_dist/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
_KEY, _TIMED_OUT = _PREFIX + "/heartbeat/{}", _PREFIX + "/timed_out/{}"


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than its timeout for the other ranks."""


class Heartbeat:
    """The last finished step of every rank, kept in ``store`` (default: the process
    group's store)."""

    def __init__(self, rank: int, world_size: int, store=None):
        self.rank, self.world_size = rank, world_size
        self.store = store if store is not None else dist.distributed_c10d._get_default_store()

    def beat(self, step: int) -> None:
        self.store.set(_KEY.format(self.rank), str(step))

    def last_steps(self) -> dict[int, int | None]:
        """Each rank's last finished step (``None``: none recorded, or the store did not answer)."""
        return {r: self._read(_KEY.format(r)) for r in range(self.world_size)}

    def silent_ranks(self, step: int, grace_s: float) -> list[int]:
        """Report this rank's timeout at ``step``; the other ranks that have not reported
        one within ``grace_s`` seconds."""
        self.store.set(_TIMED_OUT.format(self.rank), str(step))
        others = [r for r in range(self.world_size) if r != self.rank]
        deadline = time.monotonic() + grace_s
        while True:
            silent = [r for r in others if self._read(_TIMED_OUT.format(r)) is None]
            if not silent or time.monotonic() >= deadline:
                return silent
            time.sleep(0.2)

    def _read(self, key: str) -> int | None:
        try:
            return int(self.store.get(key)) if self.store.check([key]) else None
        except Exception:  # the store itself may be gone with the lost rank
            return None


def shorten_timeouts(seconds: float) -> None:
    """Set ``seconds`` as the timeout of the default group and of every group created since."""
    timeout = datetime.timedelta(seconds=seconds)
    c10d = dist.distributed_c10d  # torch's own per-group timeout setter (as torchtitan uses it)
    for group in list(c10d._world.pg_map):
        if not c10d._rank_not_in_group(group):
            c10d._set_pg_timeout(timeout, group)


def is_timeout(e: BaseException) -> bool:
    """A collective's timeout, as gloo (``Timed out waiting``) and NCCL (``timed out``) report it."""
    return "timed out" in str(e).lower() or "timeout" in type(e).__name__.lower()


def timeout_message(heartbeat: Heartbeat, step: int, seconds: float, *, grace_s: float = 10.0) -> str:
    """One line naming the frozen or lost ranks (see the module note)."""
    last = heartbeat.last_steps()
    behind = sorted(r for r, s in last.items() if r != heartbeat.rank and (s is None or s < step - 1))
    if behind:
        who = ", ".join(f"rank {r} (last finished step {last[r] if last[r] is not None else 'none'})"
                        for r in behind)
    else:
        behind = heartbeat.silent_ranks(step, grace_s)
        who = ", ".join(f"rank {r} (no timeout of its own reported within {grace_s:g} s)" for r in behind)
    cause = (f"{'it is' if len(behind) == 1 else 'they are'} frozen or lost: {who}" if behind else
             "every rank timed out in it (the network or a collective outside the job's ranks)")
    return (f"rank {heartbeat.rank}: a collective of step {step} waited more than {seconds:g} s for the "
            f"other ranks; {cause}. Restart the job (it resumes from the last checkpoint) without the failed "
            f"rank's host, or raise --collective-timeout")
