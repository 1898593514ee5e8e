"""``launch.train`` on 2 gloo ranks (FSDP=2), in-process through ``loop.train``.

Multi-process runs (each training run costs seconds on CPU; one test per configuration, so
that pytest-xdist spreads them), a one-block tiny model, 8 steps each:

* every named recipe trains: the first loss is the untrained ``log(vocab)`` and matches
  bf16's first loss (same init and data; quantized forward), the loss falls, both ranks
  report the same (all-reduced) losses, and the metrics JSONL holds one record per step;
* the parallel variants train too: MoE with expert parallelism (EP=2), tensor parallelism
  (TP=2), ``--quantized-init`` (FSDP2 of quantized weights), whose first loss equals the
  high-precision-init run's (same draws; fprop reads the same quantized weight), and the
  GPU default path, meta-device init of the sharded model, with activation checkpointing;
  an MoE model trains the same with EP=2 as with EP=1 (bf16; same init, data and
  gradient scaling, only reduction orders differ);
* resuming from the DCP checkpoint a run took at step 4 reproduces its later losses
  bitwise, for the configurations with state beyond the weights: delayed-scaling amax
  histories, stochastic rounding (Linear and per-expert GroupedLinear), expert-parallel
  experts (checkpoint keys carry the EP slot) and quantized parameters (the checkpoint
  holds the fp32 masters, requantized on load); with torchao installed, ``--baseline
  torchao-float8`` (float8 all-gather) trains and resumes too.

Tiers (``tests/_tiers.py``): the fast tier trains ``fp8_delayed`` and
``mxfp8_fwd_nvfp4_bwd`` (both resumed) next to bf16, and the TP variant; the other recipes,
variants and pairs are in the slow tier.
"""

from __future__ import annotations

import json
import math
import os

import pytest

import hybrid_dist as hd
from tests._tiers import by_recipe, recipe_groups, slow
from tests_distributed._harness import run_ranks

STEPS = 8
HALF = STEPS // 2
RESUMED_RECIPES = ("fp8_delayed", "mxfp8_fwd_nvfp4_bwd")  # amax history; stochastic rounding
# name -> (config, also checkpoint at HALF and resume); each is a test of its own, so that
# pytest-xdist spreads them over the cores and each has its own timeout; all but
# FAST_VARIANTS are in the slow tier
FAST_VARIANTS = ("tp2_mxfp8_fwd_nvfp4_bwd",)
VARIANTS = {
    "moe4_ep2_nvfp4": (dict(recipe="nvfp4", moe_experts=4, ep=2), True),
    "tp2_mxfp8_fwd_nvfp4_bwd": (dict(recipe="mxfp8_fwd_nvfp4_bwd", fsdp=1, tp=2, batch_size=8), False),  # one dp rank
    "quantized_init_moe4_ep2_mxfp8_fwd_nvfp4_bwd": (
        dict(recipe="mxfp8_fwd_nvfp4_bwd", quantized_init=True, moe_experts=4, ep=2), True),
    "meta_init_ac_fp8_current": (dict(recipe="fp8_current", init="meta", activation_checkpointing=True), False),
}
# tests that compare two runs: name -> ((name, config, resume) of each run)
PAIRS = {
    "moe4_bf16_ep2_vs_ep1": (("moe4_ep1_bf16", dict(recipe="bf16", moe_experts=4), False),
                             ("moe4_ep2_bf16", dict(recipe="bf16", moe_experts=4, ep=2), False)),
    "fsdp_copy_in_default_vs_torch": (("copy_in_torch", dict(recipe="fp8_current", fsdp_copy_in="torch"), False),
                                      ("copy_in_default", dict(recipe="fp8_current"), False)),
    "fp8_current_quantized_init_vs_hp_init": (
        ("fp8_current", dict(recipe="fp8_current"), False),
        ("quantized_init_fp8_current", dict(recipe="fp8_current", quantized_init=True), True)),
}


def _cfg(recipe: str = "bf16", **kw):
    from hybrid_dist.launch.config import TrainConfig

    kw = {"fsdp": 2, "batch_size": 4, "layers": 1, "steps": STEPS, **kw}
    return TrainConfig(preset="tiny", recipe=recipe, seq_len=64, lr=3e-3, warmup=1,
                       min_lr_ratio=1.0, quiet=True, **kw)


def _torchao_imports() -> bool:
    from hybrid_dist.launch import torchao_baseline

    try:
        torchao_baseline.check_available()
    except ImportError:
        return False
    return True


def _train(tmp: str, name: str, kw: dict, *, resume: bool):
    """``(losses, resumed losses or None)`` of one configuration."""
    from hybrid_dist.launch.loop import train

    if not resume:
        return train(_cfg(**kw))["losses"], None
    ckpt = os.path.join(tmp, f"ckpt-{name}")
    full = train(_cfg(**kw, checkpoint_dir=ckpt, save_every=HALF))["losses"]
    resumed = train(_cfg(**kw, resume=os.path.join(ckpt, f"step_{HALF:06d}")))["losses"]
    return full, resumed


def _train_recipes(rank, world_size, tmp, recipes):
    out = {}
    for recipe in ["bf16", *recipes]:  # bf16's first loss is the reference
        metrics = os.path.join(tmp, f"{recipe}.jsonl")
        out[recipe] = _train(tmp, recipe, dict(recipe=recipe, metrics=metrics), resume=recipe in RESUMED_RECIPES)
    return out


def _train_runs(rank, world_size, tmp, runs):
    """``{name: (losses, resumed losses or None)}`` of each ``(name, config, resume)``."""
    return {name: _train(tmp, name, kw, resume=resume) for name, kw, resume in runs}


def _check_falls(where: str, losses: list[float], failures: list[str]) -> bool:
    if not all(math.isfinite(x) for x in losses):
        failures.append(f"{where}: non-finite loss {losses}")
        return False
    if not losses[-1] < losses[0] - 0.5:
        failures.append(f"{where}: loss did not fall by 0.5 in {STEPS} steps: {losses}")
    return True


def _check_resume(where: str, full: list[float], resumed: list[float] | None, failures: list[str]):
    if resumed is not None and (len(full) != STEPS or resumed != full[HALF:]):
        failures.append(f"{where}: resumed from step {HALF}: losses {resumed} != uninterrupted {full[HALF:]} "
                        f"(full run {full})")


@pytest.mark.parametrize("recipes", recipe_groups([n for n in hd.RECIPE_NAMES if n != "bf16"]))
def test_every_recipe_trains_and_resume_is_bitwise(tmp_path, recipes):
    r0, r1 = run_ranks(_train_recipes, 2, str(tmp_path), recipes)
    failures = []
    bf16_first = r0["bf16"][0][0]
    for recipe, (losses, resumed) in r0.items():
        where = f"recipe={recipe} tiny layers=1 fsdp=2 gloo"
        if (losses, resumed) != r1[recipe]:
            failures.append(f"{where}: ranks disagree on the all-reduced loss: {losses} vs {r1[recipe][0]}")
        if not _check_falls(where, losses, failures):
            continue
        if abs(losses[0] - math.log(512)) > 0.15:
            failures.append(f"{where}: first loss {losses[0]:.4f} is not the untrained log(512)=6.238")
        if abs(losses[0] - bf16_first) > 0.05:
            failures.append(f"{where}: first loss {losses[0]:.4f} differs from bf16's {bf16_first:.4f} by > 0.05")
        _check_resume(where, losses, resumed, failures)
        with open(tmp_path / f"{recipe}.jsonl") as f:
            logged = [json.loads(line) for line in f]
        steps = [rec["loss"] for rec in logged if rec["event"] == "step"][:STEPS]  # the uninterrupted run's
        if steps != losses or logged[-1]["event"] != "summary" or logged[-1]["final_loss"] != losses[-1]:
            failures.append(f"{where}: metrics JSONL does not match the losses ({steps} vs {losses})")
    assert not failures, "\n".join(failures)


def _run_and_check(tmp_path, runs):
    """Rank 0's ``{name: (losses, resumed)}`` of ``runs`` on 2 gloo ranks, and the failures of
    the checks every run must pass (the loss falls; a resumed run continues bitwise)."""
    r0, _ = run_ranks(_train_runs, 2, str(tmp_path), runs)
    failures = []
    for name, (losses, resumed) in r0.items():
        where = f"variant {name} tiny layers=1 gloo 2 ranks"
        if _check_falls(where, losses, failures):
            _check_resume(where, losses, resumed, failures)
    return r0, failures


@pytest.mark.parametrize("name", by_recipe(VARIANTS, fast=FAST_VARIANTS))
def test_parallel_variant_trains_and_resume_is_bitwise(tmp_path, name):
    kw, resume = VARIANTS[name]
    _, failures = _run_and_check(tmp_path, [(name, kw, resume)])
    assert not failures, "\n".join(failures)


@slow
def test_moe_bf16_trains_the_same_with_ep2_as_with_ep1(tmp_path):
    r0, failures = _run_and_check(tmp_path, PAIRS["moe4_bf16_ep2_vs_ep1"])
    differ = ep_losses_differ(r0["moe4_ep1_bf16"][0], r0["moe4_ep2_bf16"][0], "MoE bf16 fsdp=2")
    if differ:
        failures.append(differ)
    assert not failures, "\n".join(failures)


def ep_losses_differ(ep1: list, ep2: list, where: str) -> str | None:
    """Why EP=2 losses are not EP=1's up to reduction order, or None: early steps agree to
    fp32 rounding; later, Adam's tiny second moments amplify the different summation orders
    (measured: identical for 3 steps, then <= 1.1e-4)."""
    early = max(abs(a - b) for a, b in zip(ep1[:3], ep2[:3]))
    late = max(abs(a - b) for a, b in zip(ep1, ep2))
    if early <= 1e-5 and late <= 1e-3:
        return None
    return (f"{where}: EP=2 losses {ep2} differ from EP=1 {ep1} (max |diff| {early:.2e} over 3 steps, "
            f"{late:.2e} over {STEPS}; same init and data, only reduction orders differ)")


def _copy_in_runs(rank, world_size, tmp):
    from hybrid_dist.launch import fsdp_copy_in

    calls, real = [], fsdp_copy_in.copy_in
    fsdp_copy_in.copy_in = lambda *a: calls.append(1) or real(*a)
    try:
        out = {}
        for name, kw, _ in PAIRS["fsdp_copy_in_default_vs_torch"]:
            before = len(calls)
            out[name] = (_train(tmp, name, kw, resume=False)[0], len(calls) - before)
        return out
    finally:
        fsdp_copy_in.copy_in = real
        fsdp_copy_in.uninstall()


def test_fsdp_copy_in_default_trains_bitwise_like_torch(tmp_path):
    """By default (``--fsdp-copy-in auto`` on a torch whose FSDP2 allows it) every
    reduce-scatter's gradients are packed by ``fsdp2.grad_copy_in`` (two FSDP units, one call
    each per step) into the bytes of FSDP2's own copy-in: the same losses, step for step;
    ``torch`` leaves FSDP2's own in place."""
    r0, _ = run_ranks(_copy_in_runs, 2, str(tmp_path))
    (theirs, torch_calls), (ours, hd_calls) = r0["copy_in_torch"], r0["copy_in_default"]
    where = "fp8_current tiny layers=1 fsdp=2 gloo"
    assert torch_calls == 0 and hd_calls == 2 * STEPS, f"{where}: copy_in calls torch {torch_calls}, hd {hd_calls}"
    assert ours == theirs and len(ours) == STEPS, f"{where}: default copy-in losses {ours} != torch's {theirs}"


def _reshard_runs(rank, world_size, tmp):
    """Per ``--reshard-after-forward`` policy: (losses, all-gather bytes of each step)."""
    from hybrid_dist.launch.loop import train

    out = {}
    for policy in ("always", "default", "never"):
        metrics = os.path.join(tmp, f"reshard-{policy}.jsonl")
        losses = train(_cfg("fp8_current", quantized_init=True, layers=2, reshard_after_forward=policy,
                            metrics=metrics))["losses"]
        logged = [json.loads(line) for line in open(metrics)] if rank == 0 else []
        out[policy] = (losses, [r["ag_bytes"] for r in logged if r["event"] == "step"])
    return out


def test_reshard_after_forward_policies_train_bitwise_alike(tmp_path):
    """``--reshard-after-forward always | default | never`` gather the same weights at other
    times: the same losses, bitwise. Bytes: ``default`` gathers block 0 again in backward
    (``never`` does not) and its last block once with both directions, per-tensor FP8 sending
    the codes once: so ``default`` is as far above ``never`` (block 0's backward gather) as
    ``always`` is above ``default`` (the last block's backward gather)."""
    from hybrid_dist.launch.model import Block
    from hybrid_dist.launch.presets import preset

    r0, _ = run_ranks(_reshard_runs, 2, str(tmp_path))
    where = "fp8_current qinit tiny layers=2 fsdp=2 gloo"
    (always, ag_always), (default, ag_default), (never, ag_never) = (r0[p] for p in ("always", "default", "never"))
    assert always == default == never and len(default) == STEPS, f"{where}: losses {always} / {default} / {never}"
    # one block's gather: its FP8 weights at 1 byte per element (one direction), its fp32 norms
    block = Block(preset("tiny"))
    one_pass = sum(p.numel() * (4 if "norm" in n else 1) for n, p in block.named_parameters())
    for step, (a, d, n) in enumerate(zip(ag_always, ag_default, ag_never)):
        assert a - d == d - n == one_pass, (
            f"{where} step {step + 1}: all-gather bytes {a} / {d} / {n}, one pass {one_pass}")


def _unit_runs(rank, world_size, tmp):
    """Per ``--fsdp-unit``: (losses, all-gather bytes of each step); then the compiled
    run's Dynamo counts under units of 2 blocks."""
    from hybrid_dist.launch.loop import train

    out = {}
    for unit in (1, 2, 4):
        metrics = os.path.join(tmp, f"unit-{unit}.jsonl")
        losses = train(_cfg("fp8_current", quantized_init=True, layers=4, fsdp_unit=unit, metrics=metrics))["losses"]
        logged = [json.loads(line) for line in open(metrics)] if rank == 0 else []
        out[unit] = (losses, [r["ag_bytes"] for r in logged if r["event"] == "step"])
    out["compiled"] = _compiled_run(_cfg("fp8_current", quantized_init=True, layers=4, fsdp_unit=2, compile=True,
                                         steps=2))["compile_stats"]
    return out


def test_fsdp_units_of_several_blocks_train_bitwise_alike(tmp_path):
    """``--fsdp-unit N`` shards N consecutive blocks as one FSDP2 unit: the same losses,
    bitwise, for units of 1, 2 and 4 of 4 blocks. Only the last unit stays unsharded from
    forward to backward by default, so the backward gathers blocks 0-2, then 0-1, then none:
    the bytes step down by one block's pass, then by two. Compiled: one graph, no break."""
    from hybrid_dist.launch.model import Block
    from hybrid_dist.launch.presets import preset

    r0, _ = run_ranks(_unit_runs, 2, str(tmp_path))
    where = "fp8_current qinit tiny layers=4 fsdp=2 gloo"
    (l1, ag1), (l2, ag2), (l4, ag4) = (r0[u] for u in (1, 2, 4))
    assert l1 == l2 == l4 and len(l1) == STEPS, f"{where}: losses unit 1 {l1} / 2 {l2} / 4 {l4}"
    block = Block(preset("tiny"))
    one_pass = sum(p.numel() * (4 if "norm" in n else 1) for n, p in block.named_parameters())
    for step, (a, b, c) in enumerate(zip(ag1, ag2, ag4)):
        assert (a - b, b - c) == (one_pass, 2 * one_pass), (
            f"{where} step {step + 1}: all-gather bytes units of 1 / 2 / 4: {a} / {b} / {c}, one pass {one_pass}")
    assert r0["compiled"] == {"graphs": 1, "graph_breaks": 0}, f"{where} --fsdp-unit 2 --compile: {r0['compiled']}"


def test_fsdp_units_group_consecutive_blocks():
    import torch

    from hybrid_dist.launch.parallelize import fsdp_units

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({str(i): torch.nn.Linear(2, 2) for i in range(5)})
    blocks = list(model.layers.values())
    assert fsdp_units(model) == [[b] for b in blocks]
    assert fsdp_units(model, 2) == [blocks[0:2], blocks[2:4], blocks[4:5]]
    assert fsdp_units(model, 8) == [blocks]


@slow
def test_quantized_init_first_loss_equals_high_precision_init(tmp_path):
    r0, failures = _run_and_check(tmp_path, PAIRS["fp8_current_quantized_init_vs_hp_init"])
    q_first, hp_first = r0["quantized_init_fp8_current"][0][0], r0["fp8_current"][0][0]
    if q_first != hp_first:
        failures.append(f"quantized init fp8_current: first loss {q_first} != high-precision init's {hp_first} "
                        "(same draws, same quantized fprop weight)")
    assert not failures, "\n".join(failures)


@slow
@pytest.mark.skipif(not _torchao_imports(), reason="torchao not installed (optional baseline)")
def test_torchao_float8_baseline_trains_and_resumes(tmp_path):
    _, failures = _run_and_check(tmp_path, [("torchao-float8", dict(baseline="torchao-float8"), True)])
    assert not failures, "\n".join(failures)


def _read_back_runs(rank, world_size, tmp):
    from hybrid_dist.launch.loop import train

    out = {}
    for every in (1, 3):
        path = os.path.join(tmp, f"every{every}.jsonl")
        losses = train(_cfg("fp8_current", log_every=every, metrics=path))["losses"]
        logged = [json.loads(line) for line in open(path)] if rank == 0 else []
        out[every] = (losses, [(r["step"], r["loss"]) for r in logged if r["event"] == "step"])
        if rank == 0 and every == 3:
            out["host"] = ([r.get("host_s") for r in logged if r["event"] == "step"], logged[-1].get("host_ms"))
    return out


def test_losses_read_back_every_3_steps_equal_every_step(tmp_path):
    """The loop reads losses back at log steps only (the host queues the steps between): every
    step's loss is still returned and written, bitwise those of reading back every step."""
    r0, _ = run_ranks(_read_back_runs, 2, str(tmp_path))
    (every1, logged1), (every3, logged3) = r0[1], r0[3]
    where = "fp8_current tiny layers=1 fsdp=2 gloo, --log-every 3 vs 1"
    assert every3 == every1 and len(every1) == STEPS, f"{where}: losses {every3} != {every1}"
    assert logged3 == logged1 == list(enumerate(every1, 1)), f"{where}: metrics {logged3} != {logged1}"
    per_step, mean = r0["host"]  # the host's time issuing each region, per step and its mean
    regions = ("forward", "backward", "optimizer")
    assert all(h is not None and all(h[k] > 0 for k in regions) for h in per_step), f"{where}: host_s {per_step}"
    assert mean is not None and sorted(mean) == sorted(regions), f"{where}: summary host_ms {mean}"


def _compiled_run(cfg) -> dict:
    import torch

    from hybrid_dist.launch.loop import train

    torch._dynamo.reset()  # compile from scratch: the run's compile_stats are its own
    return train(cfg)


def _moe_compiled_runs(rank, world_size):
    from hybrid_dist.launch.loop import train

    out = {}
    for ep in (1, 2):
        kw = dict(recipe="fp8_current", moe_experts=4, ep=ep, layers=2)
        eager = train(_cfg(**kw))["losses"]
        first = _compiled_run(_cfg(**kw, compile=True, steps=2))
        longer = _compiled_run(_cfg(**kw, compile=True))
        out[ep] = (eager, longer["losses"], first["compile_stats"], longer["compile_stats"])
    return out


def test_compiled_moe_launcher_graphs_do_not_grow_with_steps():
    """``--compile`` of MoE blocks (2 blocks, fp8_current): without EP one graph for both
    blocks and no break (the MoE load-balancing ``aux`` requires grad from the first block
    on, so every block sees one signature); with EP=2 the exchange runs eagerly (graph
    breaks around it), and a run of 2 steps compiles what a run of all steps does (new
    routings recompile nothing). Inductor's CPU kernels round differently from eager, so the
    first loss (before any update) agrees within 1e-4 and the compiled run trains."""
    r0, _ = run_ranks(_moe_compiled_runs, 2)
    for ep, (eager, compiled, first, longer) in r0.items():
        where = f"fp8_current tiny layers=2 moe_experts=4 ep={ep} fsdp=2 gloo --compile"
        if ep == 1:
            assert longer == {"graphs": 1, "graph_breaks": 0}, f"{where}: {longer}"
        assert longer == first, f"{where}: {STEPS} steps compiled {longer}, 2 steps {first}"
        assert abs(compiled[0] - eager[0]) <= 1e-4 * abs(eager[0]), f"{where}: first loss {compiled[0]} vs {eager[0]}"
        assert compiled[-1] < compiled[0] - 0.5, f"{where}: compiled losses {compiled} did not fall"
