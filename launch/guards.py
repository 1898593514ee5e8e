"""What the training loop checks so that a bad step is reported, not trained on or saved.

* ``NonFiniteLoss``: a step's (data-parallel mean) loss was NaN or inf; every rank raises
  it at that step, before anything is saved from that state (``--on-nonfinite stop``).
* ``nonfinite_anywhere(loss, grad_norm)``: whether any rank's loss or gradient norm is NaN
  or inf (one MAX all-reduce and a host sync before the optimizer step), for
  ``--on-nonfinite skip``, which drops that step's gradients on every rank instead.
* ``first_nonfinite(model, optimizer)``: the first parameter, in module order, whose value
  or gradient holds a NaN or inf on any rank, for the ``NonFiniteLoss`` message. It runs
  only once a step failed: one flag per parameter and gradient, one all-reduce (MAX) of all
  of them and one host sync, so every rank names the same parameter.
* ``nonfinite_amaxes(model)``: the quantizer slots whose delayed-scaling amax history
  holds a NaN or inf on any rank. Delayed scaling keeps its last finite scale when an amax
  is not finite, so the loss stays finite while the input was not: this is where it shows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import hybrid_dist as hd
from hybrid_dist.formats.float8 import DelayedScalingState
from hybrid_dist.inspection.collector import clean_fqn
from hybrid_dist.hybrid import HybridState


class NonFiniteLoss(RuntimeError):
    """A step's loss was NaN or inf: the job stops before saving anything from that state."""


def nonfinite_anywhere(loss: torch.Tensor, grad_norm: torch.Tensor | None = None) -> bool:
    """True on every rank when any rank's ``loss`` (or ``grad_norm``) is NaN or inf."""
    bad = ~torch.isfinite(loss.detach())
    if grad_norm is not None:
        bad = bad | ~torch.isfinite(grad_norm.detach())
    flag = bad.float().reshape(1)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _values(p: torch.Tensor, optimizer) -> torch.Tensor:
    """What holds ``p``'s values: its fp32 master under ``MasterWeightOptimizer`` (a quantized
    parameter is requantized from it after every step), else ``p``."""
    if isinstance(optimizer, hd.MasterWeightOptimizer):
        try:
            return optimizer.master_of(p)
        except ValueError:  # not optimized (frozen)
            pass
    return p


def _local_values(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` (a DTensor's local tensor), dequantized if quantized."""
    if isinstance(t, DTensor):
        t = t.to_local()
    return t.dequantize(dtype=torch.float32) if isinstance(t, hd.QuantizedTensor) else t


@torch.no_grad()
def first_nonfinite(model: nn.Module, optimizer=None, *, device: torch.device | None = None) -> str | None:
    """``"<parameter> value|grad|value and grad (k of n parameters)"`` for the first
    parameter (named as in the unwrapped model) in ``model.named_parameters()`` order whose
    values (``_values``: the fp32 master under ``MasterWeightOptimizer``) or gradient hold a
    NaN or inf on any rank (each rank checks its local shard of a DTensor); None when every
    one is finite. A collective
    when a process group is up: every rank must call it. ``device``: where the flags are
    reduced (the process group's device; default the first parameter's)."""
    named = list(model.named_parameters())
    if not named:
        return None
    device = device or _local_values(named[0][1]).device
    bad = []  # per parameter: [value, grad] non-finite here, still on the device
    for _, p in named:
        grad = torch.zeros((), dtype=torch.bool, device=device) if p.grad is None else \
            (~torch.isfinite(_local_values(p.grad))).any().to(device)
        bad.append(torch.stack([(~torch.isfinite(_local_values(_values(p, optimizer)))).any().to(device), grad]))
    flags = torch.stack(bad).float()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # one collective: every rank names the same parameter
    rows = flags.tolist()  # one host sync
    hit = [i for i, (v, g) in enumerate(rows) if v or g]
    if not hit:
        return None
    v, g = rows[hit[0]]
    what = "value and grad" if v and g else "value" if v else "grad"
    return f"{clean_fqn(named[hit[0]][0])} {what} ({len(hit)} of {len(named)} parameters)"


def _delayed_states(state, where: str):
    if isinstance(state, DelayedScalingState):
        yield where, state
    elif isinstance(state, HybridState):
        for d in ("rowwise", "columnwise"):
            yield from _delayed_states(getattr(state, d), f"{where}.{d}")
    elif isinstance(state, (list, tuple)):
        for i, s in enumerate(state):
            yield from _delayed_states(s, f"{where}[{i}]")


def nonfinite_amaxes(model: nn.Module) -> list[str]:
    """``"<module>/<tensor type>"`` of every delayed-scaling slot with a non-finite amax in
    its history on any rank (activation amaxes are per rank): one flag per slot, one MAX
    all-reduce and one host sync; a collective when a process group is up and the model
    has delayed-scaling slots."""
    slots = [(f"{name}/{t}{where}", s.amax_history)
             for name, mod in model.named_modules() for plan in getattr(mod, "_plans", {}).values()
             for t, state in plan.states.items() for where, s in _delayed_states(state, "")]
    if not slots:
        return []
    hist = [h.reshape(-1) for _, h in slots]
    if len({h.numel() for h in hist}) == 1:  # one history length (the usual case): three launches
        bad = (~torch.isfinite(torch.stack(hist))).any(dim=1).float()
    else:
        bad = torch.stack([(~torch.isfinite(h)).any() for h in hist]).float()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return [name for (name, _), b in zip(slots, bad.tolist()) if b]
