"""NCCL variants of the TP/SP tests (``@pytest.mark.gpu``; 2 or 4 GPUs of one host).

The same rank functions as the gloo tests run with ``device="cuda"``: quantized
all-gathers bitwise equal to gather-then-quantize per format and direction, bytes on the
wire, and the TP/SP MLP and gate/up blocks against the single-process module for every
named recipe. GEMM results on GPU are compared within tolerance rather than bitwise
(cuBLAS may choose another split-K for a sharded shape; see ``test_tp_linear``).
"""

from __future__ import annotations

import pytest
import torch

import hybrid_dist as hd
from tests_distributed import test_tp_gather, test_tp_linear
from tests_distributed._harness import run_nccl

pytestmark = pytest.mark.gpu


def _world() -> int:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        pytest.skip(f"needs 2 GPUs, found {n}")
    return 4 if n >= 4 else 2


def test_gather_paths_bitwise_and_bytes_nccl():
    results = run_nccl(test_tp_gather._rank_fn, _world(), "cuda")
    fails = [f"rank {r}: {m}" for r, (fs, _) in enumerate(results) for m in fs]
    assert not fails, "\n".join(fails[:20])


def test_tp_mlp_equals_single_process_nccl():
    names = tuple(hd.RECIPE_NAMES)
    results = run_nccl(test_tp_linear._rank_fn, _world(), names, names, "cuda")
    fails = [f"rank {r}: {m}" for r, (fs, _) in enumerate(results) for m in fs]
    assert not fails, f"{len(fails)} failures:\n" + "\n".join(fails[:30])
