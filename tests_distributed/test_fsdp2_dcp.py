"""DCP checkpoints of FSDP2-sharded quantized models: save on 4 gloo ranks, load on 2 and
on 1 (resharding), for every named recipe.

After one training step on 4 ranks, the model and ``hd.MasterWeightOptimizer`` state are
saved with ``torch.distributed.checkpoint``; a fresh model (other init) on 2 or 1 ranks
loads them. Loaded quantized shards must equal the reference rows bitwise, and one more
step must give bitwise the same loss and parameters as an unsharded run of two steps.
Under ``fp8_delayed`` the amax histories and scales are part of the model state dict
(``<layer>._extra_state``, replicated plain tensors: every rank saw the same batch, so
they are equal on every rank), and the loaded ones must equal the reference's bitwise.
DCP reads the shards with ``torch.load(weights_only=True)`` (the quantized tensor and its
configs are on the safe-globals list).
"""

from __future__ import annotations

import pytest
import torch

import hybrid_dist as hd
from tests._tiers import recipe_groups
from tests_distributed._harness import run_ranks
from tests_distributed.test_fsdp2_numerics import LAYERS, TOKENS, _shard_mismatches, build, loss_fn, shard


def _batches(n: int):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(TOKENS, LAYERS[0][1], generator=gen) for _ in range(n)]


def _step(model, opt, recipe, x) -> float:
    with hd.autocast(recipe):
        loss = loss_fn(model, x)
        loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _opt(model):
    return hd.MasterWeightOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-2)


def save_after_one_step(rank, world, root, names):
    import torch.distributed.checkpoint as dcp

    x = _batches(1)[0]
    for name in names:
        recipe = hd.recipe_from_name(name)
        model = shard(build(recipe), reshard=True)
        opt = _opt(model)
        _step(model, opt, recipe, x)
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=f"{root}/{name}")
    return True


def load_and_continue(rank, world, root, names):
    import torch.distributed.checkpoint as dcp

    x0, x1 = _batches(2)
    out = {}
    for name in names:
        recipe = hd.recipe_from_name(name)
        ref = build(recipe)
        ref_opt = _opt(ref)
        _step(ref, ref_opt, recipe, x0)
        model = shard(build(recipe, seed=7), reshard=True)
        opt = _opt(model)
        _step(model, opt, recipe, x0)  # allocates the optimizer state that DCP loads into
        sd = {"model": model.state_dict(), "optim": opt.state_dict()}
        dcp.load(sd, checkpoint_id=f"{root}/{name}")
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
        loaded = {fqn: _shard_mismatches(p_ref, p, rank)
                  for (fqn, p_ref), p in zip(ref.named_parameters(), model.parameters())}
        states = _state_mismatches(ref, model)
        losses = (_step(ref, ref_opt, recipe, x1), _step(model, opt, recipe, x1))
        after = {fqn: _shard_mismatches(p_ref, p, rank)
                 for (fqn, p_ref), p in zip(ref.named_parameters(), model.parameters())}
        out[name] = {"loaded": loaded, "losses": losses, "after": after, "states": states}
    return out


def _flat_states(model) -> dict[str, torch.Tensor]:
    out = {}

    def walk(prefix, d):
        for k, v in d.items():
            walk(f"{prefix}.{k}", v) if isinstance(v, dict) else out.__setitem__(f"{prefix}.{k}", v)

    for i, layer in enumerate(model):
        walk(str(i), layer.quantizer_state_dict())
    return out


def _state_mismatches(ref, model) -> dict[str, int]:
    """Delayed-scaling tensors of ``model`` vs ``ref``: differing elements (-1: missing)."""
    a, b = _flat_states(ref), _flat_states(model)
    return {k: -1 if k not in b else int((a[k] != b[k]).sum()) for k in a} | {k: -1 for k in b if k not in a}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``saved(names)``: a directory with one 4-rank checkpoint per recipe in ``names``,
    written on first use (once per module and pytest-xdist worker)."""
    dirs = {}

    def get(names):
        if tuple(names) not in dirs:
            root = str(tmp_path_factory.mktemp("fsdp2_dcp"))
            assert run_ranks(save_after_one_step, 4, root, names) == [True] * 4
            dirs[tuple(names)] = root
        return dirs[tuple(names)]

    return get


@pytest.mark.parametrize("names", recipe_groups())
@pytest.mark.parametrize("world", [2, 1], ids=["save4_load2", "save4_load1"])
def test_dcp_reshard_round_trip_every_recipe(saved, world, names):
    for rank, res in enumerate(run_ranks(load_and_continue, world, saved(names), names)):
        for name, r in res.items():
            cfg = f"{name} saved on 4 ranks, loaded on {world} (rank {rank})"
            for when in ("loaded", "after"):
                bad = {fqn: {k: v for k, v in m.items() if v} for fqn, m in r[when].items()}
                bad = {k: v for k, v in bad.items() if v}
                assert not bad, f"{cfg}: {when} shards differ from the unsharded run: {bad}"
            assert r["losses"][0] == r["losses"][1], f"{cfg}: next-step loss {r['losses']}"
            bad = {k: v for k, v in r["states"].items() if v}
            assert not bad, f"{cfg}: loaded delayed-scaling states differ from the unsharded run: {bad}"
            if name == "fp8_delayed":
                assert len(r["states"]) == len(LAYERS) * 3 * 2, f"{cfg}: states in the checkpoint {sorted(r['states'])}"
