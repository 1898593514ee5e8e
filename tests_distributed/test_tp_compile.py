"""Tensor-parallel layers under ``torch.compile(fullgraph=True)`` (``aot_eager``) on 2 gloo
ranks: no graph break, one graph, numbers bitwise the eager run's. While compiling, the TP
collectives are functional collectives (``tensor_parallel/_comm.py``, note "collectives
under torch.compile"; the amax all-reduce likewise, ``amax_sync``).

* The launcher's Megatron TP Transformer (3 tiny blocks; wq/wk/wv/w1/w3 column-parallel,
  wo/w2 row-parallel: all-reduces of outputs and input gradients, amax all-reduces of the
  sharded weights and activations), three AdamW steps: the losses.
* A sequence-parallel MLP with quantized all-gathers (and with bf16 ones) and
  reduce-scatters (``benchmarks.tp.MLP``): the output and every gradient of two steps.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hybrid_dist as hd
from tests._tiers import by_recipe, slow
from tests_distributed._harness import run_ranks

STEPS = 3
RECIPES = by_recipe(("bf16", "fp8_current", "mxfp8", "mxfp8_fwd_nvfp4_bwd"), fast=("fp8_current", "mxfp8"))


def _counted(fn, compiled: bool):
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    return (torch.compile(fn, backend=counter, fullgraph=True) if compiled else fn), counter


def _train_transformer(recipe_name: str, compiled: bool):
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh

    from hybrid_dist.launch.model import Transformer, apply_recipe
    from hybrid_dist.launch.parallelize import apply_tp
    from hybrid_dist.launch.presets import preset

    torch._dynamo.reset()
    counters.clear()
    cfg, recipe = preset("tiny", layers=3), hd.recipe_from_name(recipe_name)
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights()
    apply_recipe(model, recipe, share_quantized_inputs=False)
    apply_tp(model, init_device_mesh("cpu", (dist.get_world_size(),)))
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")  # one counter for all blocks
    if compiled:
        for name, block in list(model.layers.items()):
            model.layers[name] = torch.compile(block, backend=counter, fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)  # TP ranks read the same tokens
    losses = []
    for _ in range(STEPS):
        tokens = torch.randint(0, cfg.vocab_size, (2, 65), generator=g)
        logits, _ = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, counter.frame_count, sum(counters["graph_break"].values())


def _sp_mlp(recipe_name: str, compiled: bool, quantized_gather: bool = True):
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from benchmarks.tp import MLP
    from hybrid_dist.tensor_parallel import HybridColwiseParallel, HybridRowwiseParallel

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = MLP(64, 128, hd.recipe_from_name(recipe_name), "cpu")
    parallelize_module(model, init_device_mesh("cpu", (dist.get_world_size(),)), {
        "fc1": HybridColwiseParallel(sequence_parallel=True, quantized_gather=quantized_gather),
        "fc2": HybridRowwiseParallel(sequence_parallel=True, quantized_gather=quantized_gather)})
    fn, counter = _counted(model, compiled)
    g = torch.Generator().manual_seed(dist.get_rank())  # each rank its own sequence shard
    out = []
    for _ in range(2):
        x = torch.randn(64, 1, 64, generator=g, dtype=torch.bfloat16).requires_grad_(True)
        y = fn(x)
        y.float().square().sum().backward()
        out.append([y.detach(), x.grad] + [p.grad.to_local().clone() for p in model.parameters()])
        model.zero_grad()
    return out, counter.frame_count if compiled else 0, sum(counters["graph_break"].values())


def _compiled_and_eager(rank: int, world_size: int, fn_name: str, recipe_name: str, **kw):
    fn = {"transformer": _train_transformer, "sp_mlp": _sp_mlp}[fn_name]
    return fn(recipe_name, compiled=True, **kw), fn(recipe_name, compiled=False, **kw)


def _sp_mlp_differences(rank: int, world_size: int, recipe_name: str, quantized_gather: bool):
    """Frames, graph breaks and the (step, tensor index) pairs where compiled and eager
    differ, compared on the rank (tensors do not cross the process boundary). The compiled
    run is inside ``record_wire_bytes()``: traced code records nothing and does not break."""
    from hybrid_dist.tensor_parallel import record_wire_bytes

    with record_wire_bytes() as log:
        compiled = _sp_mlp(recipe_name, compiled=True, quantized_gather=quantized_gather)
    assert not log.events, f"compiled code logged {len(log.events)} collectives"
    out, frames, breaks = compiled
    ref, _, _ = _sp_mlp(recipe_name, compiled=False, quantized_gather=quantized_gather)
    diffs = [(step, i) for step, (got, want) in enumerate(zip(out, ref))
             for i, (a, b) in enumerate(zip(got, want)) if not torch.equal(a, b)]
    return frames, breaks, diffs


@pytest.mark.parametrize("name", RECIPES)
def test_compiled_tp_transformer_one_graph_bitwise_eager(name):
    for rank, ((losses, frames, breaks), (ref, _, _)) in enumerate(run_ranks(_compiled_and_eager, 2, "transformer",
                                                                             name)):
        where = f"{name}, launcher TP=2 on 2 gloo ranks, rank {rank}"
        assert breaks == 0, f"{where}: {breaks} graph breaks"
        assert frames == 1, f"{where}: {frames} graphs for 3 blocks x {STEPS} steps (expected 1)"
        assert losses == ref, f"{where}: compiled losses {losses} != eager {ref}"


@pytest.mark.parametrize("quantized_gather", [True, pytest.param(False, marks=slow)], ids=["quantized", "bf16_gathers"])
@pytest.mark.parametrize("name", RECIPES)
def test_compiled_sp_mlp_bitwise_eager(name, quantized_gather):
    for rank, (frames, breaks, diffs) in enumerate(run_ranks(_sp_mlp_differences, 2, name, quantized_gather)):
        gathers = "quantized gathers" if quantized_gather else "bf16 gathers"
        where = f"{name}, SP MLP with {gathers}, TP=2 on 2 gloo ranks, rank {rank}"
        assert breaks == 0, f"{where}: {breaks} graph breaks"
        assert frames == 1, f"{where}: {frames} graphs for 2 steps (expected 1)"
        # tensors: output, input grad, fc1 and fc2 weight grads
        assert not diffs, f"{where}: (step, tensor) {diffs} differ from eager"
