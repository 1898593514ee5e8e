"""``MasterWeightOptimizer`` through ``torch.distributed.checkpoint.state_dict``'s helpers,
resharding across world sizes: 2 FSDP2 ranks → 1 unsharded process, and back.

A converted Llama-shaped model with quantized weights (``tests/_tiny_llama``) trains one
step; ``get_state_dict(model, opt)`` keys the optimizer state by parameter FQN, with each
quantized weight's fp32 master under ``"master"``; DCP saves it. A fresh model (other init)
and optimizer on the other world size take ``get_model_state_dict`` /
``get_optimizer_state_dict`` (which initialise the optimizer state), load into copies of
them, and ``set_model_state_dict`` / ``set_optimizer_state_dict`` those. Quantized weights, masters and
AdamW moments must then equal an unsharded run's (its rows, when sharded) bitwise, and one
more step must give bitwise its loss and parameters.
"""

from __future__ import annotations

import pytest
import torch

import hybrid_dist as hd
from tests import _tiny_llama as tiny
from tests._tiers import recipe_groups
from tests_distributed._harness import run_ranks
from tests_distributed.test_fsdp2_converted import convert, shard_llama
from tests_distributed.test_fsdp2_numerics import _diff_count


def _step(model, opt, tokens) -> float:
    loss = tiny.loss_fn(model, tokens)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _opt(model):
    return hd.MasterWeightOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-2)


def _model(recipe, sharded: bool, seed: int = 0):
    model = convert(recipe, seed=seed)
    return shard_llama(model) if sharded else model


def save_after_one_step(rank, world, root, names, sharded):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    keys = {}
    for name in names:
        recipe = hd.recipe_from_name(name)
        model = _model(recipe, sharded)
        opt = _opt(model)
        _step(model, opt, tiny.batches(1)[0])
        msd, osd = get_state_dict(model, opt)
        keys[name] = {fqn: sorted(st) for fqn, st in osd["state"].items()}
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/{name}")
    return keys


def _rows(t: torch.Tensor, p: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(reference rows for this rank, local tensor) of ``t`` matching parameter ``p``."""
    local = getattr(p, "_local_tensor", p)
    rows = local.shape[0]
    return t[rank * rows:(rank + 1) * rows], local


def _mismatches(ref, opt_ref, model, opt, rank) -> dict[str, int]:
    """Differing bits of every quantized storage, master and AdamW moment against the reference."""
    out = {}
    for (fqn, p_ref), p in zip(ref.named_parameters(), model.parameters()):
        want, got = _rows(p_ref.detach(), p, rank)
        if isinstance(got, hd.QuantizedTensor):
            for d in ("rowwise", "columnwise"):
                for f, t in got.storage_of(d).tensors().items():
                    out[f"{fqn}.{d}.{f}"] = _diff_count(getattr(want.storage_of(d), f), t)
        else:
            out[fqn] = _diff_count(want, got)
        m_want, m_got = _rows(opt_ref.master_of(p_ref), opt.master_of(p), rank)
        out[f"{fqn}.master"] = _diff_count(m_want, getattr(m_got, "_local_tensor", m_got))
        for k in ("exp_avg", "exp_avg_sq"):
            s_want, s_got = _rows(opt_ref.state[p_ref][k], opt.state[p][k], rank)
            out[f"{fqn}.{k}"] = _diff_count(s_want, getattr(s_got, "_local_tensor", s_got))
    return out


def load_and_continue(rank, world, root, names, sharded):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.utils._pytree import tree_map_only

    x0, x1 = tiny.batches(2)
    out = {}
    for name in names:
        recipe = hd.recipe_from_name(name)
        ref = convert(recipe)
        ref_opt = _opt(ref)
        _step(ref, ref_opt, x0)
        model = _model(recipe, sharded, seed=7)
        opt = _opt(model)
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        # copies, so that only set_*_state_dict (not DCP's in-place load) reaches the model and optimizer
        sd = tree_map_only(torch.Tensor, lambda t: t.detach().clone(), sd)
        dcp.load(sd, checkpoint_id=f"{root}/{name}")
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"])
        loaded = _mismatches(ref, ref_opt, model, opt, rank)
        losses = (_step(ref, ref_opt, x1), _step(model, opt, x1))
        out[name] = {"loaded": loaded, "losses": losses, "after": _mismatches(ref, ref_opt, model, opt, rank)}
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``saved(names, world)``: a directory with one checkpoint per recipe, written by
    ``world`` ranks (2: FSDP2-sharded; 1: unsharded), on first use."""
    dirs = {}

    def get(names, world):
        key = (tuple(names), world)
        if key not in dirs:
            root = str(tmp_path_factory.mktemp("dcp_state_dict"))
            keys = run_ranks(save_after_one_step, world, root, names, world > 1)
            for name in names:
                _check_keys(keys[0][name], f"{name} saved on {world} ranks")
            dirs[key] = root
        return dirs[key]

    return get


def _check_keys(keys: dict, cfg: str) -> None:
    """Optimizer state keyed by FQN; a master for each converted (quantized) weight only."""
    want = {fqn for fqn, _ in tiny.build().named_parameters()}
    assert set(keys) == want, f"{cfg}: optimizer state keys {sorted(set(keys) ^ want)}"
    for fqn, names in keys.items():
        quantized = fqn.endswith((".q.weight", ".k.weight", ".v.weight", ".o.weight", ".gate.weight",
                                  ".up.weight", ".down.weight", "lm_head.weight"))
        expect = ["exp_avg", "exp_avg_sq", "step"] + (["master"] if quantized else [])
        assert names == sorted(expect), f"{cfg}: state of {fqn} has {names}, expected {sorted(expect)}"


@pytest.mark.parametrize("names", recipe_groups())
@pytest.mark.parametrize("save_world,load_world", [(2, 1), (1, 2)], ids=["save2_load1", "save1_load2"])
def test_dcp_state_dict_helpers_reshard(saved, names, save_world, load_world):
    root = saved(names, save_world)
    for rank, res in enumerate(run_ranks(load_and_continue, load_world, root, names, load_world > 1)):
        for name, r in res.items():
            cfg = f"{name} saved on {save_world} ranks, loaded on {load_world} (rank {rank})"
            for when in ("loaded", "after"):
                bad = {k: v for k, v in r[when].items() if v}
                assert not bad, f"{cfg}: {when}: differs from the unsharded run: {bad}"
            assert r["losses"][0] == r["losses"][1], f"{cfg}: next-step loss {r['losses']}"
