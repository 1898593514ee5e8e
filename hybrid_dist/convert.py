"""``convert_to_hybrid``: swap ``nn.Linear`` modules for ``hd.Linear`` in place;
``set_recipe``: give every recipe-aware module of a model its recipe."""

from __future__ import annotations

from typing import Callable

from torch import nn

from hybrid_dist.linear import Linear
from hybrid_dist.recipes import Recipe


def convert_to_hybrid(
    model: nn.Module,
    *,
    recipe: Recipe | None = None,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> nn.Module:
    """Replace each ``nn.Linear`` (and set the recipe of each ``hd.Linear``) for which
    ``module_filter_fn(module, fqn)`` is true. Parameters are reused, not copied, so an
    optimizer built before the swap still holds them. ``recipe=None`` leaves the recipe to
    ``hd.autocast``. Returns ``model`` (or the new module if ``model`` itself is a Linear).
    """
    if recipe is not None and not isinstance(recipe, Recipe):
        raise ValueError(f"convert_to_hybrid: recipe must be an hd.Recipe or None, got {type(recipe).__name__}")

    def swap(mod: nn.Module, fqn: str) -> nn.Module:
        if not isinstance(mod, nn.Linear) and not isinstance(mod, Linear):
            return mod
        if module_filter_fn is not None and not module_filter_fn(mod, fqn):
            return mod
        if isinstance(mod, Linear):
            mod.use_recipe(recipe, name=fqn)
            return mod
        new = Linear.__new__(Linear)
        nn.Module.__init__(new)
        new.in_features, new.out_features = mod.in_features, mod.out_features
        new._plans, new._last_recipe = {}, None
        new.weight, new.bias = mod.weight, mod.bias
        new.use_recipe(recipe, name=fqn)  # plans (and their states) now, before any compile
        return new

    def walk(parent: nn.Module, prefix: str) -> None:
        for child_name, child in list(parent.named_children()):
            fqn = f"{prefix}.{child_name}" if prefix else child_name
            new = swap(child, fqn)
            if new is not child:
                setattr(parent, child_name, new)
            else:
                walk(child, fqn)

    root = swap(model, "")
    if root is model:
        walk(model, "")
    return root


def set_recipe(model: nn.Module, recipe: Recipe | None, *,
               module_filter_fn: Callable[[nn.Module, str], bool] | None = None) -> nn.Module:
    """Set ``recipe`` on every recipe-aware module of ``model`` (``hd.Linear``,
    ``moe.GroupedLinear``, ``moe.MoE``: each module with a ``use_recipe`` method) for which
    ``module_filter_fn(module, fqn)`` is true, naming each by its qualified name and
    building its quantizers and states now. ``nn.Linear`` modules are not swapped (that is
    ``convert_to_hybrid``). Returns ``model``."""
    if recipe is not None and not isinstance(recipe, Recipe):
        raise ValueError(f"set_recipe: recipe must be an hd.Recipe or None, got {type(recipe).__name__}")
    for fqn, mod in model.named_modules():
        if callable(getattr(mod, "use_recipe", None)) and (module_filter_fn is None or module_filter_fn(mod, fqn)):
            mod.use_recipe(recipe, name=fqn)
    return model
