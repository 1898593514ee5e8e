"""Statistics under tensor parallelism (gloo, TP = 2, sequence parallel): the operands a
rank gathers (the column-parallel input, the row-parallel output gradient) are measured as
the full tensor, equal to a single-process run's rows; the operands a rank holds a shard
of are labelled ``"shard"``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

import hybrid_dist as hd
from hybrid_dist.inspection import StatsCollector
from hybrid_dist.tensor_parallel import HybridColwiseParallel, HybridRowwiseParallel
from tests_distributed._harness import run_ranks
from tests_distributed.test_tp_linear import MLP

S, B, H, F_ = 64, 2, 256, 256
FULL = {("fc1", "input"), ("fc2", "grad_output")}  # gathered along the sequence: full tensors


def _rows(collector: StatsCollector) -> dict:
    return {(r["module"], r["tensor_type"], r["direction"], r["format"]): r for r in collector.read()}


def _rank(rank, world, recipe_name):
    mesh = init_device_mesh("cpu", (world,))
    recipe = hd.recipe_from_name(recipe_name)
    ref, model = (MLP(H, F_, recipe) for _ in range(2))
    model.load_state_dict(ref.state_dict())
    parallelize_module(model, mesh, {"fc1": HybridColwiseParallel(sequence_parallel=True),
                                     "fc2": HybridRowwiseParallel(sequence_parallel=True)})
    g = torch.Generator().manual_seed(7)
    x, dy = torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)
    cref, ctp = StatsCollector(ref), StatsCollector(model)
    with cref.capture():
        ref(x).backward(dy)
    with ctp.capture():
        model(x.chunk(world)[rank]).backward(dy.chunk(world)[rank])
    want, got = _rows(cref), _rows(ctp)
    fails = []
    for key, r in want.items():
        if key not in got:
            fails.append(f"{key}: not recorded")
            continue
        if key[:2] in FULL:
            if got[key] != r:
                fails.append(f"{key}: {got[key]} != single-process {r}")
        elif got[key]["scope"] != "shard":
            fails.append(f"{key}: scope {got[key]['scope']}, a shard")
    return fails, len(want)


@pytest.mark.parametrize("recipe", ["mxfp8", "fp8_current"])
def test_sequence_parallel_gathered_operands_are_full_rows(recipe):
    for rank, (fails, n) in enumerate(run_ranks(_rank, 2, recipe)):
        assert n >= 16, f"[{recipe} TP=2 SP] rank {rank}: {n} rows"
        assert not fails, f"[{recipe} TP=2 SP] rank {rank}: " + "; ".join(fails)
