"""``launch.checkpoint``'s per-rank quantizer states: a stochastic-rounding state is saved
with both of its streams, the reference's generator and the CUDA kernels' Philox key, and
restoring the snapshot puts both back (in place), so the resumed run draws what the
uninterrupted run would have drawn."""

from __future__ import annotations

import torch
from torch import nn

import hybrid_dist as hd
from hybrid_dist.formats.nvfp4 import NVFP4State
from launch.checkpoint import load_quantizer_states, quantizer_states


def _sr_states(model):
    out = []
    for mod in model.modules():
        if isinstance(mod, hd.Linear):
            for s in mod.plan_for(mod.recipe).states.values():
                out += [p for p in (s, getattr(s, "rowwise", None), getattr(s, "columnwise", None))
                        if isinstance(p, NVFP4State)]
    return out


def test_snapshot_restores_sr_generator_and_kernel_key():
    dev = torch.device("cpu")
    model = nn.Sequential(*(hd.Linear(64, 64, recipe=hd.recipe_from_name("nvfp4"), name=f"l{i}") for i in range(2)))
    states = _sr_states(model)
    assert states, "the nvfp4 recipe should keep stochastic-rounding states"
    for i, s in enumerate(states):  # walk each stream a different distance
        for _ in range(i + 1):
            s.advance_kernel_key(dev)
            torch.rand(3, generator=s.generator(dev))
    snap = quantizer_states(model, dev)
    keys = [s.kernel_key(dev).clone() for s in states]
    live = [s.kernel_key(dev) for s in states]  # CUDA graphs hold these tensors: restored in place
    draws = [torch.rand(5, generator=s.generator(dev)) for s in states]
    for s in states:
        s.advance_kernel_key(dev)
    load_quantizer_states(model, snap, dev)
    for i, s in enumerate(states):
        assert s.kernel_key(dev) is live[i], f"state {i}: the key tensor was replaced, not restored in place"
        assert torch.equal(s.kernel_key(dev), keys[i]), f"state {i}: kernel key {s.kernel_key(dev)} != {keys[i]}"
        assert torch.equal(torch.rand(5, generator=s.generator(dev)), draws[i]), f"state {i}: generator not restored"


def test_snapshot_written_before_the_state_dict_form_still_restores():
    """Rank files written before ``NVFP4State.state_dict`` named the generator ``"generator"``
    and kept None for stateless parts; they restore the same streams."""
    dev = torch.device("cpu")
    model = nn.Sequential(hd.Linear(64, 64, recipe=hd.recipe_from_name("nvfp4"), name="l0"))
    (state,) = _sr_states(model)
    state.advance_kernel_key(dev)
    snap = quantizer_states(model, dev)
    old = {k: None if v is None else {"generator": v["generator_cpu"], "kernel_key": v["kernel_key"]}
           for k, v in snap.items()}
    assert any(v is None for v in old.values()) and any(v is not None for v in old.values())
    key, draws = state.kernel_key(dev).clone(), torch.rand(5, generator=state.generator(dev))
    state.advance_kernel_key(dev)
    load_quantizer_states(model, old, dev)
    assert torch.equal(state.kernel_key(dev), key), "kernel key not restored from the old form"
    assert torch.equal(torch.rand(5, generator=state.generator(dev)), draws), "generator not restored"
