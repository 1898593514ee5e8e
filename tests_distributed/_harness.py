"""Run a function on N ranks (processes) and collect each rank's return value.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` CPU processes on gloo;
``run_nccl(fn, world_size, *args)`` one process per CUDA device on NCCL. Each initialises a
process group over a fresh file store, calls ``fn(rank, world_size, *args)`` and the
results come back in rank order.

Gloo ranks are forked: they inherit the parent's imported torch and hybrid_dist instead of
importing them again (a spawned rank spends 10-25 s of CPU importing on a 2-core CI
machine, more than most tests' work). Spawn remains for NCCL (CUDA cannot be forked) and
whenever the parent holds a process group or CUDA context of its own. An exception on any
rank is re-raised in the parent with that rank's traceback, so a failing test names the rank and configuration.
"""

from __future__ import annotations

import os
import queue as queue_mod
import signal
import subprocess
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, world_size, store_path, backend, fn, args, queue):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world_size)
        kwargs = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            kwargs["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, **kwargs)
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


_FORK_REFUSED = "Unable to handle autograd's threading in combination with fork"
_SPAWN_ONLY = [False]  # set once a forked rank refused to run backward


def _start_method(backend: str) -> str:
    parent_state = dist.is_initialized() or torch.cuda.is_initialized() or _SPAWN_ONLY[0]
    return "fork" if backend == "gloo" and not parent_state else "spawn"


def _run(fn, world_size: int, args, *, backend: str, timeout: float):
    """``_run_once``; when forked ranks could not run autograd (a torch build whose parent
    process started autograd's device threads, e.g. a CUDA wheel without a GPU), again
    with spawned ranks, and every later run spawns."""
    try:
        return _run_once(fn, world_size, args, backend=backend, timeout=timeout)
    except AssertionError as e:
        if _FORK_REFUSED not in str(e) or _start_method(backend) != "fork":
            raise
        _SPAWN_ONLY[0] = True
        return _run_once(fn, world_size, args, backend=backend, timeout=timeout)


def _run_once(fn, world_size: int, args, *, backend: str, timeout: float):
    ctx = mp.get_context(_start_method(backend))
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        store_path = os.path.join(d, "store")
        procs = [ctx.Process(target=_worker, args=(r, world_size, store_path, backend, fn, args, queue))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        results, errors = {}, []
        try:
            for _ in range(world_size):
                try:  # after a failure, the others get 10 s to report theirs (they may wait on it forever)
                    rank, status, payload = queue.get(timeout=timeout if not errors else 10.0)
                except queue_mod.Empty:
                    if errors:
                        break
                    missing = sorted(set(range(world_size)) - set(results))
                    raise AssertionError(f"{fn.__name__} on {world_size} {backend} ranks (args={args!r}): ranks "
                                         f"{missing} reported nothing within {timeout:.0f} s") from None
                if status == "ok":
                    results[rank] = payload
                else:
                    errors.append(f"--- rank {rank} ---\n{payload}")
            for p in procs:
                p.join(timeout=60)
        finally:
            _reap(procs)
    if errors:
        raise AssertionError(
            f"{fn.__name__} failed on {world_size} {backend} ranks (args={args!r}):\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]


def _reap(procs) -> None:
    """Kill the ranks still alive (a timeout or a failed peer): left running, they would
    compete for the CI machine's two cores with every later test."""
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=10)


def run_ranks(fn, world_size: int, *args, timeout: float = 900.0):
    """``fn(rank, world_size, *args)`` on gloo CPU processes; results in rank order."""
    return _run(fn, world_size, args, backend="gloo", timeout=timeout)


def nccl_world() -> int:
    """4 when this host has 4 CUDA devices, else 2; skips the test with fewer than 2."""
    import pytest

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        pytest.skip(f"needs 2 GPUs, found {n}")
    return 4 if n >= 4 else 2


def run_nccl(fn, world_size: int, *args, timeout: float = 600.0):
    """``fn(rank, world_size, *args)`` on one NCCL process per CUDA device."""
    return _run(fn, world_size, args, backend="nccl", timeout=timeout)


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and its descendants (``torchrun`` starts its workers in their own
    process groups (setsid), so a process-group kill misses them). Linux (``ps --ppid``)."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, check=False)
    for child in [int(p) for p in out.stdout.split()]:
        kill_tree(child)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
