"""What ``hd.Linear`` and ``moe.GroupedLinear`` share: which recipe a forward uses, one
plan (quantizers + states) per recipe, and weights created under ``quantized_model_init``.

Recipe resolution: the module's own ``recipe``, else the enclosing ``hd.autocast``'s, else
none (high precision). A recompute runs inside backward, where ``hd.autocast`` is no longer
active, so it reuses the recipe of the module's last forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybrid_dist._tensor_ops import stateless
from hybrid_dist.autocast import current_recipe, model_init_recipe
from hybrid_dist.recipes import Recipe


def in_backward() -> bool:
    """True while autograd runs a backward (e.g. an activation recompute); False while tracing."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


class RecipeModuleMixin:
    """Mixed into an ``nn.Module`` that sets ``recipe``, ``name``, ``_plans = {}`` and
    ``_last_recipe = None`` and implements ``_build_plan(recipe)``."""

    recipe: Recipe | None
    _plans: dict[int, Any]  # id(recipe) -> plan (quantizers and their states)
    _last_recipe: Recipe | None  # recipe of the last forward, for recompute

    def _build_plan(self, recipe: Recipe) -> Any:
        raise NotImplementedError

    def _plan(self, recipe: Recipe) -> Any:
        plan = self._plans.get(id(recipe))
        if plan is None or plan.recipe is not recipe:
            plan = self._build_plan(recipe)
            self._plans[id(recipe)] = plan
        return plan

    def active_recipe(self) -> Recipe | None:
        return self._active_recipe(in_backward())

    def _active_recipe(self, recompute: bool) -> Recipe | None:
        recipe = self.recipe or current_recipe()
        if recompute:
            return recipe or self._last_recipe
        # eager: skip nn.Module.__setattr__ when unchanged; compiled: store unconditionally
        # (a condition on the attribute would guard on it and recompile once)
        if torch.is_grad_enabled() and (torch.compiler.is_compiling() or self._last_recipe is not recipe):
            self._last_recipe = recipe
        return recipe

    def _weight_parameter(self, w: torch.Tensor) -> nn.Parameter:
        """``w`` as a parameter; a QuantizedTensor (both directions) inside
        ``hd.quantized_model_init``, keeping the initial values when it asks to."""
        init = model_init_recipe()
        if init is None:
            return nn.Parameter(w)
        recipe, keep_hp = init
        q = stateless(self._plan(recipe).weight)  # delayed scaling has no history yet
        param = nn.Parameter(q.quantize(w, rowwise=True, columnwise=True))
        if keep_hp:
            param._hd_hp_init = w.float()
        return param
