"""Save and resume with ``torch.distributed.checkpoint`` (DCP).

Layout: ``<checkpoint_dir>/step_<N>/`` holds the DCP checkpoint of the (sharded) model and
optimizer state, plus ``rank<r>.pt`` with what is local to each rank: the quantizer states
of every ``hd.Linear`` (delayed-scaling amax histories, stochastic-rounding generators),
so a resumed run reproduces the uninterrupted run bitwise. The data is stateless (a
function of the step), so only the step number is needed to continue it.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import hybrid_dist as hd
from hybrid_dist.formats.nvfp4 import NVFP4State
from hybrid_dist.hybrid import HybridState

_STEP_DIR = re.compile(r"^step_(\d+)$")


def _snapshot(state: Any, device: torch.device) -> Any:
    if state is None:
        return None
    if isinstance(state, list):  # GroupedLinear: one state per expert
        return [_snapshot(s, device) for s in state]
    if isinstance(state, hd.DelayedScalingState):
        return {"amax_history": state.amax_history.clone(), "scale": state.scale.clone()}
    if isinstance(state, NVFP4State):
        return {"generator": state.generator(device).get_state()}
    if isinstance(state, HybridState):
        return {"rowwise": _snapshot(state.rowwise, device), "columnwise": _snapshot(state.columnwise, device)}
    raise NotImplementedError(f"checkpoint: cannot save quantizer state of type {type(state).__name__}")


def _restore(state: Any, snap: Any, device: torch.device) -> None:
    if state is None:
        return
    if isinstance(state, list):
        for s, snap_s in zip(state, snap, strict=True):
            _restore(s, snap_s, device)
    elif isinstance(state, hd.DelayedScalingState):
        state.amax_history, state.scale = snap["amax_history"].clone(), snap["scale"].clone()
    elif isinstance(state, NVFP4State):
        state.generator(device).set_state(snap["generator"])
    elif isinstance(state, HybridState):
        _restore(state.rowwise, snap["rowwise"], device)
        _restore(state.columnwise, snap["columnwise"], device)


def _states(model: nn.Module):
    """(qualified name, {tensor_type: state}) of every ``hd.Linear`` and ``GroupedLinear``
    with a recipe; builds the plan (and its fresh states) if the module has not run yet."""
    from hybrid_dist.moe import GroupedLinear

    for name, mod in model.named_modules():
        if isinstance(mod, hd.Linear) and mod.recipe is not None:
            yield name, mod._plan(mod.recipe).states
        elif isinstance(mod, GroupedLinear) and mod.recipe is not None:
            yield name, mod.plan(mod.recipe).states


def quantizer_states(model: nn.Module, device: torch.device) -> dict[str, Any]:
    return {f"{name}/{t}": _snapshot(s, device) for name, states in _states(model) for t, s in states.items()}


def load_quantizer_states(model: nn.Module, snaps: dict[str, Any], device: torch.device) -> None:
    for name, states in _states(model):
        for t, s in states.items():
            _restore(s, snaps[f"{name}/{t}"], device)


def save(directory: str, step: int, model: nn.Module, optimizer, device: torch.device) -> str:
    """Write ``directory/step_<step>`` and return its path."""
    path = os.path.join(directory, f"step_{step:06d}")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    torch.save({"step": step, "quantizer_states": quantizer_states(model, device)},
               os.path.join(path, f"rank{dist.get_rank()}.pt"))
    dist.barrier()
    return path


def resolve(path: str) -> str:
    """A step directory as given, or the latest ``step_<N>`` inside a checkpoint directory."""
    if os.path.exists(os.path.join(path, ".metadata")):
        return path
    steps = sorted(d for d in os.listdir(path) if _STEP_DIR.match(d)) if os.path.isdir(path) else []
    if not steps:
        raise ValueError(f"--resume {path!r}: no DCP checkpoint there (expected .metadata or step_<N>/ dirs)")
    return os.path.join(path, steps[-1])


def load(path: str, model: nn.Module, optimizer, device: torch.device) -> int:
    """Restore model, optimizer and quantizer states; return the step the checkpoint was taken at."""
    path = resolve(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    local = torch.load(os.path.join(path, f"rank{dist.get_rank()}.pt"), weights_only=False)
    load_quantizer_states(model, local["quantizer_states"], device)
    return int(local["step"])
