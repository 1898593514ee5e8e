"""Run a function on N gloo ranks (CPU processes) and collect each rank's return value.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes, initialises a gloo
process group over a fresh file store, calls ``fn(rank, world_size, *args)`` and returns
the list of results (rank order). An exception on any rank is re-raised in the parent with
that rank's traceback, so a failing test names the rank and configuration.
"""

from __future__ import annotations

import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, world_size, store_path, fn, args, queue):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 300.0):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        store_path = os.path.join(d, "store")
        procs = [ctx.Process(target=_worker, args=(r, world_size, store_path, fn, args, queue))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        results, errors = {}, []
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = payload
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
        for p in procs:
            p.join(timeout=60)
    if errors:
        raise AssertionError(f"{fn.__name__} failed on {world_size} ranks (args={args!r}):\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
