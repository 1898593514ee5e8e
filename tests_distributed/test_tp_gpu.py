"""NCCL variants of the TP/SP tests (``@pytest.mark.gpu``; 2 or 4 GPUs of one host).

The same rank functions as the gloo tests run with ``device="cuda"``: quantized
all-gathers bitwise equal to gather-then-quantize per format and direction, bytes on the
wire, and the TP/SP MLP and gate/up blocks against the single-process module for every
named recipe. GEMM results on GPU are compared within tolerance rather than bitwise
(cuBLAS may choose another split-K for a sharded shape; see ``test_tp_linear``).
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
from tests_distributed import test_tp_gather, test_tp_linear

pytestmark = pytest.mark.gpu


def _world() -> int:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        pytest.skip(f"needs 2 GPUs, found {n}")
    return 4 if n >= 4 else 2


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
    """``run_ranks`` for NCCL: one process per GPU, results in rank order."""
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
        raise AssertionError(f"{fn.__name__} failed on {world} GPUs:\n" + "\n".join(errors))
    return [results[r] for r in range(world)]


def test_gather_paths_bitwise_and_bytes_nccl():
    results = run_nccl(test_tp_gather._rank_fn, _world(), "cuda")
    fails = [f"rank {r}: {m}" for r, (fs, _) in enumerate(results) for m in fs]
    assert not fails, "\n".join(fails[:20])


def test_tp_mlp_equals_single_process_nccl():
    names = tuple(hd.RECIPE_NAMES)
    results = run_nccl(test_tp_linear._rank_fn, _world(), names, names, "cuda")
    fails = [f"rank {r}: {m}" for r, (fs, _) in enumerate(results) for m in fs]
    assert not fails, f"{len(fails)} failures:\n" + "\n".join(fails[:30])
