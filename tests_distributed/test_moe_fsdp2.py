"""FSDP2 (gloo, 2 ranks) with expert weights sharded along the expert dim: GroupedLinear
under ``fully_shard`` equals the unsharded layer, bitwise.

Each rank runs its own tokens; the forward must equal an unsharded GroupedLinear on those
tokens, and the sharded gradient (reduce-scatter, mean over 2 ranks) must equal the mean
of the unsharded per-rank gradients — exact here, since a sum of two fp32 values and a
division by 2 do not depend on the order. Covers high-precision weights (quantized in each
forward) and ``hd.quantized_model_init`` (QuantizedTensor parameters).
"""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import hybrid_dist as hd
from hybrid_dist.moe import GroupedLinear
from tests_distributed._harness import run_nccl, run_ranks

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


def _poison_fsdp_allocations():
    """Fill every storage FSDP2 re-allocates before an all-gather with 0xFF bytes (NaN in
    every float format), as a GPU's caching allocator hands back memory holding other data."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    def poisoned(tensor):
        storage = tensor.untyped_storage()
        if storage.size() != tensor.numel() * tensor.itemsize:
            storage.resize_(tensor.numel() * tensor.itemsize)
            torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).fill_(0xFF)

    _fsdp_param.alloc_storage = _fsdp_param_group.alloc_storage = poisoned


class _Root(torch.nn.Module):
    def __init__(self, recipe):
        super().__init__()
        torch.manual_seed(0)
        with hd.quantized_model_init(recipe):
            self.experts = GroupedLinear(E, K, N, recipe=recipe, dtype=torch.bfloat16)

    def forward(self, x, splits):
        return self.experts(x, splits)


def _resharded_worker(rank, world, device="cpu"):
    """A quantized-init GroupedLinear on the sync-free grouped path (the CUDA path; emulated
    on CPU, where the re-allocated storages are filled with NaN bytes as the caching allocator
    may leave them) as a block that reshards after forward, two steps, against the unsharded
    layer."""
    from hybrid_dist.moe import grouped_quantized

    if device == "cpu":
        grouped_quantized.fits = lambda plan, x, w: grouped_quantized.unsupported_reason(plan, x, w) is None
        _poison_fsdp_allocations()
    torch.set_default_device(device)
    mesh = init_device_mesh(device, (world,))
    splits = torch.tensor([10, 0, 30, 24])
    for recipe_name in ("fp8_current", "mxfp8"):
        recipe = hd.recipe_from_name(recipe_name)

        ref, sharded = _Root(recipe), _Root(recipe)
        fully_shard(sharded.experts, mesh=mesh, reshard_after_forward=True)
        fully_shard(sharded, mesh=mesh)
        for step in range(2):
            cfg = f"FSDP2 world={world} recipe={recipe_name} quantized_init resharded step={step}"
            torch.manual_seed(10 + step)
            x = torch.randn(int(splits.sum()), K, dtype=torch.bfloat16)
            dy = torch.randn(int(splits.sum()), N, dtype=torch.bfloat16)
            got = []
            for m in (ref, sharded):
                xi = x.clone().requires_grad_(True)
                m(xi, splits).backward(dy)
                got.append((xi.grad, m.experts.weight.grad))
            (dx_ref, dw_ref), (dx, dw) = got
            assert torch.equal(dx, dx_ref), f"{cfg}: dx differs from the unsharded layer"
            assert torch.equal(dw.full_tensor(), dw_ref), f"{cfg}: dW differs from the unsharded layer"
            ref.experts.weight.grad = sharded.experts.weight.grad = None
    return True


def test_fsdp2_resharded_quantized_experts_backward_reads_refilled_columnwise():
    """FSDP2 gathers only the rowwise direction for the forward of a block that reshards,
    and refills the columnwise buffers before its backward: the grouped path's dgrad must
    read them then (re-allocated buffers hold NaN bytes until refilled). Two ranks: on one,
    the unsharded tensor shares the shard's fields and nothing is re-allocated."""
    assert run_ranks(_resharded_worker, 2) == [True, True]


@pytest.mark.gpu
def test_fsdp2_resharded_quantized_experts_on_cuda():
    """The same on two CUDA devices over NCCL, on the grouped path's CUDA kernels."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    assert run_nccl(_resharded_worker, 2, "cuda") == [True, True]
