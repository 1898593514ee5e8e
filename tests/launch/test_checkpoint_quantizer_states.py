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
            for s in mod._plan(mod.recipe).states.values():
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
