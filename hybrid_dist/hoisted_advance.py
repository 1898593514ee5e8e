"""Delayed scaling's per-forward state advance, moved out of the modules into the model.

A layer whose plan keeps delayed-scaling states starts a pass of them at each of its own
forwards ([Note: recompute and delayed scaling] in ``linear``). Inside a compiled
activation checkpoint, AOTAutograd's recompute would rerun that advance from the already
advanced states, so those regions run eagerly. ``hoist_delayed_advance(model)`` moves the
advance of every such plan into one forward pre-hook of ``model``: each model forward
starts every plan's pass once, before any block runs, and the layers' forwards (recomputed
or not) only read their states and record amaxes, which a compiled checkpoint traces whole.

The numerics are those of advancing in each layer's forward as long as each layer runs
once per model forward (no layer reused within a forward). Expert-parallel MoE layers
(their exchange advances the experts' input states) and tensor-parallel linears (a
prepared input's state is advanced by its preparing hook) are refused.
"""

from __future__ import annotations

from torch import nn

__all__ = ["hoist_delayed_advance"]


def hoist_delayed_advance(model: nn.Module) -> int:
    """Move every own-recipe layer's delayed-scaling advance of ``model`` into a forward
    pre-hook of ``model`` (module doc); returns how many plans moved (0: no hook added)."""
    plans = []
    for name, m in model.named_modules():
        if getattr(m, "_hd_tp", None) is not None or getattr(m, "ep_group", None) is not None:
            raise ValueError(f"hoist_delayed_advance: {name or 'the model'} is tensor- or expert-parallel, "
                             "whose forward advances states of its own")
        recipe = getattr(m, "recipe", None)
        if recipe is None or not hasattr(m, "plan_for"):
            continue
        plan = m.plan_for(recipe)
        if not plan.advances_state:
            continue
        if not hasattr(plan, "hoist"):
            raise ValueError(f"hoist_delayed_advance: {name}'s plan ({type(plan).__name__}) cannot be hoisted")
        plan.hoist()
        plans.append(plan)
    if plans:
        model.register_forward_pre_hook(lambda module, args: _start_passes(plans))
    return len(plans)


def _start_passes(plans) -> None:
    for plan in plans:
        plan.start_forward_pass()
