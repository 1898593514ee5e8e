"""FSDP2 (HSDP on a 2D ``(replicate, shard)`` mesh) of quantized models at world sizes 8
and 64 on the fake process group: the collectives of one training step, asserted.

Per step of a 3-layer model (each layer its own FSDP group, ``reshard_after_forward=True``,
the root holds no parameters) we expect: 3 forward + 3 backward all-gathers over the shard
group, 3 reduce-scatters, 3 replicate-group all-reduces of the gradients, and — for recipes
with a per-tensor scale — exactly **one** more all-reduce: the MAX of every parameter's amax
after the optimizer step. Bytes: each all-gather output holds the whole direction the pass
needs (forward: rowwise, backward: columnwise), measured on the c10d op itself.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import hybrid_dist as hd

try:
    from torch.distributed.tensor.debug import CommDebugMode
except ImportError:  # older layout
    from torch.distributed._tensor.debug import CommDebugMode

DIM, LAYERS = 256, 3
# recipe -> (forward, backward) all-gather bytes per weight element, per-tensor scales?
EXPECTED = {
    "bf16": (4.0, 4.0, False),
    "fp8_current": (1.0, 1.0, True),
    "mxfp8": (1 + 1 / 32, 1 + 1 / 32, False),
    "nvfp4": (0.5 + 1 / 256, 0.5 + 1 / 256, True),
    "mxfp8_fwd_nvfp4_bwd": (1 + 1 / 32, 1 + 1 / 32, True),  # packed: max(row, col) both passes
}


class _AllGatherBytes(TorchDispatchMode):
    """Output bytes of every c10d all-gather issued inside the mode."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "allgather" in str(func):
            out = args[0]
            outs = out if isinstance(out, (list, tuple)) else [out]
            self.sizes.append(sum(t.numel() * t.element_size() for t in outs if isinstance(t, torch.Tensor)))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def fake_world(request):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = request.param
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield world
    finally:
        dist.destroy_process_group()


def _counts(comm) -> dict[str, int]:
    return {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}


@pytest.mark.parametrize("fake_world,replicate", [(8, 2), (64, 8)], indirect=["fake_world"],
                         ids=["world8_mesh2x4", "world64_mesh8x8"])
def test_hsdp_collectives_per_step(fake_world, replicate):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = fake_world
    mesh = init_device_mesh("cpu", (replicate, world // replicate), mesh_dim_names=("replicate", "shard"))
    for name, (fwd, bwd, per_tensor) in EXPECTED.items():
        recipe = hd.recipe_from_name(name)
        torch.manual_seed(0)
        with hd.quantized_model_init(recipe, keep_high_precision_init=False):
            model = torch.nn.Sequential(*[hd.Linear(DIM, DIM, bias=False) for _ in range(LAYERS)])
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = hd.MasterWeightOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-2)
        x = torch.randn(64, DIM)
        for step in range(2 if name == "fp8_current" else 1):
            cfg = f"{name} world={world} mesh={replicate}x{world // replicate} step={step}"
            with CommDebugMode() as comm, _AllGatherBytes() as ag:
                with hd.autocast(recipe):
                    model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
            expected = {"_allgather_base_": 2 * LAYERS, "_reduce_scatter_base_": LAYERS,
                        "allreduce_": LAYERS + (1 if per_tensor else 0)}
            assert _counts(comm) == expected, f"{cfg}: collectives {_counts(comm)} != {expected}"
            layer_elems = DIM * DIM
            want = [fwd * layer_elems] * LAYERS + [bwd * layer_elems] * LAYERS
            assert ag.sizes == pytest.approx(want), f"{cfg}: all-gather bytes {ag.sizes} != {want}"
