"""What the training loop checks so that a bad step is reported, not trained on or saved.

* ``NonFiniteLoss``: a step's (data-parallel mean) loss was NaN or inf; every rank raises
  it at that step, before anything is saved from that state (``--on-nonfinite stop``).
* ``nonfinite_anywhere(loss, grad_norm)``: whether any rank's loss or gradient norm is NaN
  or inf (one MAX all-reduce and a host sync before the optimizer step), for
  ``--on-nonfinite skip``, which drops that step's gradients on every rank instead.
* ``nonfinite_amaxes(model)``: the quantizer slots whose delayed-scaling amax history
  holds a NaN or inf. Delayed scaling keeps its last finite scale when an amax is not
  finite, so the loss stays finite while the input was not: this is where it shows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hybrid_dist.formats.float8 import DelayedScalingState
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
    its history (one device sync for the whole model when every amax is finite)."""
    slots = [(f"{name}/{t}{where}", s.amax_history)
             for name, mod in model.named_modules() for plan in getattr(mod, "_plans", {}).values()
             for t, state in plan.states.items() for where, s in _delayed_states(state, "")]
    if not slots or bool(torch.isfinite(torch.cat([h.reshape(-1) for _, h in slots])).all()):
        return []
    return [name for name, h in slots if not bool(torch.isfinite(h).all())]
