"""Save and resume with ``torch.distributed.checkpoint`` (DCP).

Layout: ``<checkpoint_dir>/step_<N>/`` holds the DCP checkpoint of the (sharded) model and
optimizer state (with ``--quantized-init``: the fp32 master weights in place of the
quantized parameters, which are requantized from them on load; under expert parallelism
each EP rank's experts under a key naming its EP slot), plus ``rank<r>.pt`` with what is
local to each rank: the quantizer states of every ``hd.Linear`` (delayed-scaling amax
histories; stochastic rounding's generator and CUDA-kernel Philox key), so a resumed run reproduces the uninterrupted
run bitwise. The data is stateless (a function of the step), so only the step number is
needed to continue it.

[Note: complete, verified checkpoints]
A step is written to ``step_<N>.partial/``; once every rank's files are there, the ranks
checksum a share of the files each, and rank 0 writes ``COMPLETE`` (JSON: step, world size,
the run's identity, and a CRC-32 and size of every file) and renames the directory to
``step_<N>/``. So a save killed half-way leaves only a ``.partial`` directory, which resume
ignores: ``--resume DIR`` takes the newest step with a ``COMPLETE`` record. Before loading,
every file is checked against its record (a share per rank) and each rank file against its
rank; a mismatch raises ``ValueError`` naming the file on every rank. Rank files hold only
tensors, numbers and strings and load with ``weights_only=True``: one holding anything else
(a crafted pickle) runs nothing and raises ``ValueError`` naming it.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import zlib
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils._pytree import tree_map

import hybrid_dist as hd
from hybrid_dist.recipe_module import load_state_tensors, state_tensors

_STEP_DIR = re.compile(r"^step_(\d+)$")
COMPLETE = "COMPLETE"  # the record that makes a step directory a checkpoint (module note)


def _snapshot(state: Any, device: torch.device) -> Any:
    """A CPU copy of a plan state's tensors (``recipe_module.state_tensors``: the module
    state dict's form), or None without state."""
    tensors = state_tensors(state, device)
    return None if tensors is None else tree_map(lambda t: t.to("cpu", copy=True), tensors)


def _current_form(snap: Any, device: torch.device) -> Any:
    """``snap`` in ``state_tensors``' form. Checkpoints written before it held per-expert
    lists, None for stateless parts and an SR state's generator as ``"generator"``."""
    if isinstance(snap, list):
        snap = {str(i): s for i, s in enumerate(snap)}
    if not isinstance(snap, dict):
        return snap
    return {f"generator_{device.type}" if k == "generator" else k: _current_form(v, device)
            for k, v in snap.items() if v is not None}


def _restore(state: Any, snap: Any, device: torch.device, where: str) -> None:
    snap = _current_form(snap, device)
    if snap:
        load_state_tensors(state, snap, where)


def _states(model: nn.Module):
    """(qualified name, {tensor_type: state}) of every ``hd.Linear`` and ``GroupedLinear``
    with a recipe; builds the plan (and its fresh states) if the module has not run yet."""
    from hybrid_dist.moe import GroupedLinear

    for name, mod in model.named_modules():
        if isinstance(mod, hd.Linear) and mod.recipe is not None:
            yield name, mod.plan_for(mod.recipe).states
        elif isinstance(mod, GroupedLinear) and mod.recipe is not None:
            yield name, mod.plan(mod.recipe).states


def quantizer_states(model: nn.Module, device: torch.device) -> dict[str, Any]:
    return {f"{name}/{t}": _snapshot(s, device) for name, states in _states(model) for t, s in states.items()}


def load_quantizer_states(model: nn.Module, snaps: dict[str, Any], device: torch.device) -> None:
    for name, states in _states(model):
        for t, s in states.items():
            _restore(s, snaps[f"{name}/{t}"], device, f"{name}/{t}")


def copy_quantizer_states(model: nn.Module, device: torch.device) -> dict[str, Any]:
    """``quantizer_states`` copied on the device (no host sync), for
    ``load_quantizer_states`` to undo a step (``--on-nonfinite skip``)."""
    copies = {}
    for name, states in _states(model):
        for t, s in states.items():
            tensors = state_tensors(s, device)
            copies[f"{name}/{t}"] = None if tensors is None else tree_map(lambda x: x.clone(), tensors)
    return copies


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
        st = optimizer.state[p]
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


def save(directory: str, step: int, model: nn.Module, optimizer, device: torch.device, *,
         run: dict | None = None) -> str:
    """Write ``directory/step_<step>`` atomically (module note) and return its path. ``run``:
    what identifies the run (JSON-serialisable), kept in the ``COMPLETE`` record."""
    final = os.path.join(directory, f"step_{step:06d}")
    partial = final + ".partial"
    rank = dist.get_rank()
    if rank == 0 and os.path.exists(partial):
        shutil.rmtree(partial)  # left by a save that was killed
    dist.barrier()
    dcp.save(_state(model, optimizer), checkpoint_id=partial)
    torch.save({"step": step, "rank": rank, "world_size": dist.get_world_size(),
                "quantizer_states": quantizer_states(model, device)}, os.path.join(partial, f"rank{rank}.pt"))
    dist.barrier()
    # each rank checksums its share of the files (every file once); rank 0 writes the record
    shares = [None] * dist.get_world_size()
    dist.all_gather_object(shares, {f: _file_record(os.path.join(partial, f)) for f in _my_share(partial)})
    if rank == 0:
        files = {f: r for share in shares for f, r in share.items()}
        with open(os.path.join(partial, COMPLETE), "w") as fh:
            json.dump({"step": step, "world_size": dist.get_world_size(), "run": run or {}, "files": files}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(partial, final)
    dist.barrier()
    return final


def _my_share(step_dir: str, names=None) -> list[str]:
    """This rank's share of a step's files (``names``, default all in the directory but the
    record): every ``world``-th file in sorted order, so the ranks read each file once."""
    names = sorted(f for f in os.listdir(step_dir) if f != COMPLETE) if names is None else sorted(names)
    return names[dist.get_rank()::dist.get_world_size()]


def _file_record(path: str) -> dict:
    crc, size = 0, 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return {"crc32": crc, "size": size}


def complete_record(step_dir: str) -> dict | None:
    """The ``COMPLETE`` record of a step directory, or None (not a finished checkpoint)."""
    try:
        with open(os.path.join(step_dir, COMPLETE)) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def complete_steps(directory: str) -> list[str]:
    """The finished ``step_<N>`` directories in ``directory``, oldest first."""
    if not os.path.isdir(directory):
        return []
    steps = sorted(d for d in os.listdir(directory) if _STEP_DIR.match(d))
    return [os.path.join(directory, d) for d in steps if complete_record(os.path.join(directory, d)) is not None]


def resolve(path: str) -> str:
    """A finished step directory as given, or the newest finished ``step_<N>`` inside a
    checkpoint directory (unfinished ``.partial`` saves are skipped)."""
    if os.path.exists(os.path.join(path, ".metadata")) or os.path.exists(os.path.join(path, COMPLETE)):
        if complete_record(path) is None:
            raise ValueError(f"--resume {path!r}: this step has no {COMPLETE} record (its save did not finish); "
                             f"resume from its checkpoint directory to take the newest finished step")
        return path
    done = complete_steps(path)
    if not done:
        raise ValueError(f"--resume {path!r}: no finished checkpoint there (expected step_<N>/ directories "
                         f"with a {COMPLETE} record)")
    return done[-1]


def verify(step_dir: str, names=None) -> dict:
    """Check the files ``names`` (default: all) of a finished step against its record;
    return the record."""
    record = complete_record(step_dir)
    if record is None:
        raise ValueError(f"checkpoint {step_dir!r}: no {COMPLETE} record")
    for name in record["files"] if names is None else names:
        want = record["files"][name]
        path = os.path.join(step_dir, name)
        if not os.path.exists(path):
            raise ValueError(f"checkpoint {step_dir!r}: {name} is missing")
        got = _file_record(path)
        if got != want:
            raise ValueError(f"checkpoint {step_dir!r}: {name} is corrupted (size {got['size']}, CRC-32 "
                             f"{got['crc32']:#010x}; written as size {want['size']}, CRC-32 {want['crc32']:#010x})")
    return record


def _read_rank_file(path: str, src: int) -> dict:
    """``rank<src>.pt`` of step directory ``path``, loaded with ``weights_only=True`` and
    checked to be rank ``src``'s; ``ValueError`` naming the file otherwise."""
    try:
        local = torch.load(os.path.join(path, f"rank{src}.pt"), weights_only=True)
    except pickle.UnpicklingError as e:  # objects other than tensors, numbers and strings: nothing ran
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        why = next((ln for ln in lines if "GLOBAL" in ln.upper()), lines[-1] if lines else "")
        raise ValueError(f"checkpoint {path!r}: rank{src}.pt is not a rank file of this launcher: it holds "
                         f"objects that load only with weights_only=False, which is never used ({why.strip()})") \
            from None
    if local.get("rank", src) != src:
        raise ValueError(f"checkpoint {path!r}: rank{src}.pt holds the state of rank {local.get('rank')} "
                         "(rank files swapped or copied between checkpoints)")
    return local


def load(path: str, model: nn.Module, optimizer, device: torch.device) -> int:
    """Restore model, optimizer and quantizer states; return the step the checkpoint was taken at."""
    path = resolve(path)
    record = complete_record(path)
    # another world size: rank r takes the quantizer states of rank r mod the saved world size
    src = dist.get_rank() % int(record["world_size"])
    problem, local = None, None
    try:  # each rank checks its share of the files and its rank file; all raise the first problem
        verify(path, _my_share(path, record["files"]))
        local = _read_rank_file(path, src)
    except ValueError as e:
        problem = str(e)
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    if any(problems):
        raise ValueError(next(p for p in problems if p))
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
    load_quantizer_states(model, local["quantizer_states"], device)
    return int(local["step"])
