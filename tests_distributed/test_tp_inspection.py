"""Statistics under tensor parallelism (gloo, TP = 2, sequence parallel): the operands a
rank gathers (the column-parallel input, also one prepared once for several consumers by
``PrepareHybridModuleInput``; the row-parallel output gradient) are measured as the full
tensor, equal to a single-process run's rows; the operands a rank holds a shard of are
labelled ``"shard"``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

import hybrid_dist as hd
from hybrid_dist.inspection import StatsCollector
from hybrid_dist.tensor_parallel import HybridColwiseParallel, HybridRowwiseParallel, PrepareHybridModuleInput
from tests.inspection.test_capture import rows_clean_and_stale
from tests_distributed._harness import run_ranks
from tests_distributed.test_tp_linear import MLP, GateUp

S, B, H, F_ = 64, 2, 256, 256
# gathered along the sequence: full tensors
FULL = {("fc1", "input"), ("fc2", "grad_output"), ("gate", "input"), ("up", "input"), ("down", "grad_output")}
PLANS = {
    "mlp": (MLP, lambda: {"fc1": HybridColwiseParallel(sequence_parallel=True),
                          "fc2": HybridRowwiseParallel(sequence_parallel=True)}),
    "prepared gate/up": (GateUp, lambda: {"": PrepareHybridModuleInput(consumers=("gate", "up")),
                                          "gate": HybridColwiseParallel(sequence_parallel=True),
                                          "up": HybridColwiseParallel(sequence_parallel=True),
                                          "down": HybridRowwiseParallel(sequence_parallel=True)}),
}


def _rows(collector: StatsCollector) -> dict:
    return {(r["module"], r["tensor_type"], r["direction"], r["format"]): r for r in collector.read()}


def _rank(rank, world, recipe_name, model_name):
    mesh = init_device_mesh("cpu", (world,))
    recipe = hd.recipe_from_name(recipe_name)
    cls, plan = PLANS[model_name]
    ref, model = (cls(H, F_, recipe) for _ in range(2))
    model.load_state_dict(ref.state_dict())
    parallelize_module(model, mesh, plan())
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


@pytest.mark.parametrize("model_name", list(PLANS))
@pytest.mark.parametrize("recipe", ["mxfp8", "fp8_current"])
def test_sequence_parallel_gathered_operands_are_full_rows(recipe, model_name):
    cfg = f"[{recipe} TP=2 SP {model_name}]"
    for rank, (fails, n) in enumerate(run_ranks(_rank, 2, recipe, model_name)):
        assert n >= 16, f"{cfg} rank {rank}: {n} rows"
        assert not fails, f"{cfg} rank {rank}: " + "; ".join(fails)


def _stale_rank(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    recipe = hd.recipe_from_name("fp8_current")
    torch.manual_seed(0)
    with hd.quantized_model_init(recipe):
        model = MLP(H, F_, recipe)
    parallelize_module(model, mesh, {"fc1": HybridColwiseParallel(), "fc2": HybridRowwiseParallel()})
    g = torch.Generator().manual_seed(7)
    x, dy = torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)
    weights = [model.fc1.weight.to_local(), model.fc2.weight.to_local()]
    # x requires grad: both layers' dgrad, so both weights' columnwise rows
    rows = rows_clean_and_stale(model, weights, lambda: model(x.clone().requires_grad_(True)), dy, _rows)
    cols = [k for k in rows[0] if k[1:3] == ("weight", "columnwise")]
    assert len(cols) == 2, f"rank {rank}: weight columnwise rows {cols}"
    assert rows[1] == rows[0], f"rank {rank}: rows differ when the weights' columnwise bytes were stale in forward"
    return True


def test_quantized_weights_columnwise_recorded_from_backward():
    """TP = 2 (gloo), quantized-init weights: a weight's columnwise row comes from the bytes its
    dgrad reads in backward (FSDP2 refills them then), not from the forward's."""
    assert run_ranks(_stale_rank, 2) == [True, True]
