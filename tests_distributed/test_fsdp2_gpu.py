"""The FSDP2 numeric tests under NCCL on 2–4 CUDA devices (``@pytest.mark.gpu``).

Same functions and assertions as the gloo tests (``test_fsdp2_numerics``), run by an NCCL
launcher here: one process per device, ``init_process_group("nccl")``. Skipped without
CUDA (conftest) and without at least 2 devices.
"""

from __future__ import annotations

import os
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import hybrid_dist as hd
from tests_distributed import test_fsdp2_numerics as numerics

pytestmark = pytest.mark.gpu


def _worker(rank, world, store_path, fn, args, queue):
    try:
        torch.cuda.set_device(rank)
        store = dist.FileStore(store_path, world)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank))
        queue.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_nccl(fn, world: int, *args, timeout: float = 600.0):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_worker, args=(r, world, os.path.join(d, "store"), fn, args, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        results, errors = {}, []
        for _ in range(world):
            rank, status, payload = queue.get(timeout=timeout)
            (results.__setitem__(rank, payload) if status == "ok" else errors.append(f"--- rank {rank} ---\n{payload}"))
        for p in procs:
            p.join(timeout=60)
    if errors:
        raise AssertionError(f"{fn.__name__} failed on {world} NCCL ranks:\n" + "\n".join(errors))
    return [results[r] for r in range(world)]


def _need(n: int) -> None:
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA devices, found {torch.cuda.device_count()}")


def test_nccl_fsdp2_trains_like_unsharded_2_ranks_every_recipe():
    _need(2)
    for r in run_nccl(numerics.train_and_compare, 2, list(hd.RECIPE_NAMES), True, "cuda"):
        numerics._check(r, 2, exact=True, reshard=True, gpu=True)


def test_nccl_fsdp2_4_ranks_no_reshard():
    _need(4)
    names = ["fp8_current", "fp8_block", "nvfp4", "mxfp8_fwd_nvfp4_bwd"]
    for r in run_nccl(numerics.train_and_compare, 4, names, False, "cuda", 2):
        numerics._check(r, 4, exact=False, reshard=False, gpu=True)
