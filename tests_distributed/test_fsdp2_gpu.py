"""The FSDP2 numeric tests under NCCL on 2–4 CUDA devices (``@pytest.mark.gpu``).

Same functions and assertions as the gloo tests (``test_fsdp2_numerics``), run by an NCCL
launcher here: one process per device, ``init_process_group("nccl")``. Skipped without
CUDA (conftest) and without at least 2 devices.
"""

from __future__ import annotations

import pytest
import torch

import hybrid_dist as hd
from tests_distributed import test_fsdp2_numerics as numerics
from tests_distributed._harness import run_nccl

pytestmark = pytest.mark.gpu


def _need(n: int) -> None:
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA devices, found {torch.cuda.device_count()}")


def _check_every_recipe(results, world: int, **kw) -> None:
    """Check each rank and recipe separately and report every failing one, not the first."""
    fails = []
    for rank, r in enumerate(results):
        for name in r:
            try:
                numerics._check({name: r[name]}, world, gpu=True, **kw)
            except AssertionError as e:
                fails.append(f"rank {rank} {name}: {str(e).splitlines()[0]}")
    assert not fails, f"{len(fails)} failing (rank, recipe) pairs:\n" + "\n".join(fails)


def test_nccl_fsdp2_trains_like_unsharded_2_ranks_every_recipe():
    _need(2)
    results = run_nccl(numerics.train_and_compare, 2, list(hd.RECIPE_NAMES), True, "cuda")
    _check_every_recipe(results, 2, exact=True, reshard=True)


def test_nccl_fsdp2_4_ranks_no_reshard():
    _need(4)
    names = ["fp8_current", "fp8_block", "nvfp4", "mxfp8_fwd_nvfp4_bwd"]
    results = run_nccl(numerics.train_and_compare, 4, names, False, "cuda", 2)
    _check_every_recipe(results, 4, exact=False, reshard=False)
