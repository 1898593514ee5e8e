"""FSDP2 (gloo, 2 ranks) with expert weights sharded along the expert dim: GroupedLinear
under ``fully_shard`` equals the unsharded layer, bitwise.

Each rank runs its own tokens; the forward must equal an unsharded GroupedLinear on those
tokens, and the sharded gradient (reduce-scatter, mean over 2 ranks) must equal the mean
of the unsharded per-rank gradients — exact here, since a sum of two fp32 values and a
division by 2 do not depend on the order. Covers high-precision weights (quantized in each
forward) and ``hd.quantized_model_init`` (QuantizedTensor parameters).
"""

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import hybrid_dist as hd
from hybrid_dist.moe import GroupedLinear
from tests_distributed._harness import run_ranks

E, K, N = 4, 64, 64
SPLITS = [[10, 0, 30, 24], [3, 40, 0, 21]]  # per rank
CONFIGS = [("mxfp8", False), ("mxfp8", True), ("fp8_current", False), ("fp8_current", True)]


def _make(recipe, quantized_init):
    torch.manual_seed(0)
    if quantized_init:
        with hd.quantized_model_init(recipe):
            return GroupedLinear(E, K, N, recipe=recipe)
    return GroupedLinear(E, K, N, recipe=recipe)


def _step(g, rank):
    torch.manual_seed(100 + rank)
    x = torch.randn(sum(SPLITS[rank]), K)
    y = g(x, torch.tensor(SPLITS[rank]))
    y.backward(torch.randn_like(y))
    return y.detach()


def _worker(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    e_l = E // world
    for recipe_name, qinit in CONFIGS:
        cfg = f"FSDP2 world={world} rank={rank} recipe={recipe_name} quantized_init={qinit}"
        recipe = hd.recipe_from_name(recipe_name)
        sharded = fully_shard(_make(recipe, qinit), mesh=mesh)
        y = _step(sharded, rank)
        refs = []
        for r in range(world):
            ref = _make(recipe, qinit)
            y_ref = _step(ref, r)
            refs.append(ref.weight.grad)
            if r == rank:
                assert torch.equal(y, y_ref), f"{cfg}: forward differs from the unsharded layer"
        mean = (refs[0] + refs[1]) / 2
        got = sharded.weight.grad.to_local()
        assert got.shape == (e_l, N, K), f"{cfg}: local grad shape {tuple(got.shape)}"
        assert torch.equal(got, mean[rank * e_l:(rank + 1) * e_l]), f"{cfg}: sharded dW != mean of unsharded dW"
    return True


def test_fsdp2_expert_sharding_bitwise():
    assert run_ranks(_worker, 2) == [True, True]
