"""FSDP2 numerics of every named recipe on 1–4 CUDA devices (``@pytest.mark.gpu``), and a
per-layer probe of the first forward.

Same functions and assertions as the gloo tests (``test_fsdp2_numerics``), run by an NCCL
launcher here: one process per device, ``init_process_group("nccl")``. Skipped without
CUDA (conftest) and without the devices a test names.
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
                fails.append(f"rank {rank} {name}: {str(e).splitlines()[0]}\n{_diagnosis(r[name])}")
    assert not fails, f"{len(fails)} failing (rank, recipe) pairs:\n" + "\n".join(fails)


def _diagnosis(r) -> str:
    """Everything a failing recipe measured, so one GPU run locates the fault: per-step
    losses, the unsharded fields that differ from the full quantized tensor, the shards
    that differ from the reference rows, and the masters' SQNR."""
    unsharded = {k: v for k, v in r["unsharded"].items() if v}
    shards = {f"{fqn}.{k}": v for fqn, p in r["params"].items() for k, v in p["shard"].items() if v}
    sqnr = {fqn: round(p["master_sqnr"], 1) for fqn, p in r["params"].items()}
    return (f"    losses (unsharded, sharded): {r['losses']}\n    unsharded mismatches: {unsharded}\n"
            f"    shard mismatches: {shards}\n    master SQNR dB: {sqnr}")


def test_nccl_fsdp2_trains_like_unsharded_1_rank_every_recipe():
    """One rank: the unsharded tensors share the shards' fields ("local" mode, one
    placeholder byte per gather)."""
    _need(1)
    results = run_nccl(numerics.train_and_compare, 1, list(hd.RECIPE_NAMES), True, "cuda")
    _check_every_recipe(results, 1, exact=True, reshard=True)


def test_nccl_fsdp2_trains_like_unsharded_2_ranks_every_recipe():
    _need(2)
    results = run_nccl(numerics.train_and_compare, 2, list(hd.RECIPE_NAMES), True, "cuda")
    _check_every_recipe(results, 2, exact=True, reshard=True)


def test_nccl_fsdp2_kept_init_trains_like_unsharded_2_ranks_every_recipe():
    """``quantized_model_init``'s default: the kept fp32 init reaches each CUDA shard, whose
    masters start bitwise from its rows."""
    _need(2)
    results = run_nccl(numerics.train_and_compare, 2, list(hd.RECIPE_NAMES), True, "cuda", numerics.STEPS, True)
    _check_every_recipe(results, 2, exact=True, reshard=True)
    bad = [(rank, name) for rank, r in enumerate(results) for name, res in r.items() if not res["init_masters"]]
    assert not bad, f"(rank, recipe) whose sharded masters did not start from the init rows: {bad}"


@pytest.mark.parametrize("world", [2, 4])
def test_nccl_fsdp2_no_reshard(world):
    """``reshard_after_forward=False``: every gather carries both directions ("both" mode;
    per-tensor FP8 sends its codes once and transposes after the gather)."""
    _need(world)
    names = ["fp8_current", "fp8_block", "nvfp4", "mxfp8_fwd_nvfp4_bwd"]
    results = run_nccl(numerics.train_and_compare, world, names, False, "cuda", 2)
    _check_every_recipe(results, world, exact=False, reshard=False)


def probe_forward(rank, world, names, device_type="cuda"):
    """Per recipe, step 0, one forward: each layer's output of the sharded model against
    the unsharded one (max |diff| / max |ref|), and the same layer recomputed from a
    contiguous copy of FSDP's unsharded weight (tells wrong gathered bytes from a GEMM
    that misreads the gathered views)."""
    device = numerics.rank_device(rank, device_type)
    out = {}
    for name in names:
        recipe = hd.recipe_from_name(name)
        ref = numerics.build(recipe, device=device)
        model = numerics.shard(numerics.build(recipe, device=device), reshard=True)
        outs = {"ref": [], "sh": [], "sh_copy": [], "sh_views": []}

        def grab(key):
            return lambda m, a, y: outs[key].append(y.detach().clone())

        def grab_copy(m, a):  # pre-hook: FSDP's unsharded weight is installed now
            w = m.weight
            w_copy = hd.QuantizedTensor(w.shape, w.dtype, *(
                None if w.storage_of(d) is None else w.storage_of(d).map_tensors(lambda t: t.clone())
                for d in ("rowwise", "columnwise")), w.quantizer)
            outs["sh_copy"].append(torch.nn.functional.linear(a[0], w_copy.dequantize().to(a[0].dtype)))
            outs["sh_views"].append(torch.nn.functional.linear(a[0], w.dequantize().to(a[0].dtype)))

        for layer in ref:
            layer.register_forward_hook(grab("ref"))
        for layer in model:
            layer.register_forward_hook(grab("sh"))
            layer.register_forward_pre_hook(grab_copy)
        x = torch.randn(numerics.TOKENS, numerics.LAYERS[0][1], generator=torch.Generator().manual_seed(1)).to(device)
        with hd.autocast(recipe), torch.no_grad():
            ref(x)
            model(x)
        rel = lambda a, b: float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
        out[name] = [{"sharded_vs_ref": rel(sh, r), "dequant_views_vs_copy": rel(v, c)}
                     for r, sh, v, c in zip(outs["ref"], outs["sh"], outs["sh_views"], outs["sh_copy"])]
    return out


def test_nccl_fsdp2_forward_probe_2_ranks():
    """Step-0 forward per layer (see ``probe_forward``); fails naming each bad layer."""
    _need(2)
    results = run_nccl(probe_forward, 2, list(hd.RECIPE_NAMES))
    bad = [f"rank {rank} {name} layer {i}: {d}" for rank, r in enumerate(results) for name, layers in r.items()
           for i, d in enumerate(layers) if d["sharded_vs_ref"] > 1e-6 or d["dequant_views_vs_copy"] > 0]
    assert not bad, "\n".join(bad)
