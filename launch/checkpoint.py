"""Save and resume with ``torch.distributed.checkpoint`` (DCP).

Layout: ``<checkpoint_dir>/step_<N>/`` holds the DCP checkpoint of the (sharded) model and
optimizer state (with ``--quantized-init``: the fp32 master weights in place of the
quantized parameters, which are requantized from them on load; under expert parallelism
each EP rank's experts under a key naming its EP slot), plus ``rank<r>.pt`` with what is
local to each rank: the quantizer states of every ``hd.Linear`` (delayed-scaling amax
histories; stochastic rounding's generator and CUDA-kernel Philox key), so a resumed run reproduces the uninterrupted
run bitwise. The data is stateless (a function of the step), so only the step number is
needed to continue it.
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
    if isinstance(state, NVFP4State):  # the reference's generator and the CUDA kernels' Philox key
        return {k: v.to("cpu", copy=True) for k, v in state.state_dict(device).items()}
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
        if "generator" in snap:  # written before NVFP4State.state_dict: the generator of `device`
            snap = {k: v for k, v in snap.items() if k != "generator"} | {f"generator_{device.type}": snap["generator"]}
        state.load_state_dict(snap)  # a checkpoint written before the key was saved has none
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


_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")  # activation checkpointing, torch.compile
_EXPERTS = ("moe.fc1.weight", "moe.fc2.weight")


def _clean(fqn: str) -> str:
    for w in _WRAPPERS:
        fqn = fqn.replace(w, "")
    return fqn


def _disk_key(model: nn.Module, fqn: str) -> str:
    """The checkpoint key of parameter ``fqn``. Under expert parallelism each EP rank holds
    different experts under the same name (sharded over the ranks holding the same ones),
    so their keys carry the EP slot; everything else keeps its name."""
    ep_rank, ep_size = getattr(model, "ep_slot", (0, 1))
    return f"{fqn}@ep{ep_rank}of{ep_size}" if ep_size > 1 and fqn.endswith(_EXPERTS) else fqn


def _rename(model: nn.Module, sd: dict, *, to_disk: bool) -> dict:
    """``sd`` keyed by checkpoint keys (``to_disk``) or back by parameter names."""
    if to_disk:
        return {_disk_key(model, k): v for k, v in sd.items()}
    names = {_disk_key(model, _clean(n)): _clean(n) for n, _ in model.named_parameters()}
    return {names.get(k, k): v for k, v in sd.items()}


def _master_state(model: nn.Module, optimizer: hd.MasterWeightOptimizer) -> tuple[dict, dict]:
    """FQN-keyed state of a model trained through ``MasterWeightOptimizer`` (``--quantized-init``):
    the fp32 masters stand in for the quantized parameters (which are requantized from them
    on load), and AdamW's state is keyed by the parameter's name. A parameter not stepped yet
    gets zero state (what AdamW would create). The param groups are not saved: the loop sets
    the learning rate every step and the rest comes from the config. Returns (model, optim)."""
    model_sd, state = {}, {}
    for name, p in model.named_parameters():
        m = optimizer.master_of(p)
        key = _disk_key(model, _clean(name))
        model_sd[key] = m
        st = optimizer.state[m]
        if not st:  # AdamW's lazy initial state
            st.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(m), exp_avg_sq=torch.zeros_like(m))
        state[key] = st
    return model_sd, {"state": state}


def _state(model: nn.Module, optimizer) -> dict:
    if isinstance(optimizer, hd.MasterWeightOptimizer):
        model_sd, optim_sd = _master_state(model, optimizer)
        return {"model": model_sd, "optim": optim_sd}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    optim_sd["state"] = _rename(model, optim_sd["state"], to_disk=True)
    return {"model": _rename(model, model_sd, to_disk=True), "optim": optim_sd}


def save(directory: str, step: int, model: nn.Module, optimizer, device: torch.device) -> str:
    """Write ``directory/step_<step>`` and return its path."""
    path = os.path.join(directory, f"step_{step:06d}")
    dcp.save(_state(model, optimizer), checkpoint_id=path)
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
    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=path)  # in place into the tensors of ``state``
    if isinstance(optimizer, hd.MasterWeightOptimizer):
        # masters and AdamW state were loaded in place; this round trip requantizes the
        # quantized parameters from their masters, as after a step
        optimizer.load_state_dict(optimizer.state_dict())
    else:
        state["optim"]["state"] = _rename(model, state["optim"]["state"], to_disk=False)
        set_state_dict(model, optimizer, model_state_dict=_rename(model, state["model"], to_disk=False),
                       optim_state_dict=state["optim"])
    local = torch.load(os.path.join(path, f"rank{dist.get_rank()}.pt"), weights_only=False)
    load_quantizer_states(model, local["quantizer_states"], device)
    return int(local["step"])
