"""``convert_to_hybrid``: swap ``nn.Linear`` modules for ``hd.Linear`` in place, optionally
with quantized weights; ``set_recipe``: give every recipe-aware module of a model its recipe."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from hybrid_dist.linear import Linear
from hybrid_dist.quantized_tensor import QuantizedTensor
from hybrid_dist.recipe_module import quantized_weight_parameter
from hybrid_dist.recipes import Recipe
from hybrid_dist.warn import warn_once


def convert_to_hybrid(
    model: nn.Module,
    *,
    recipe: Recipe | None = None,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
    quantized_weights: bool = False,
    keep_high_precision_init: bool = True,
) -> nn.Module:
    """Replace each ``nn.Linear`` (and set the recipe of each ``hd.Linear``) for which
    ``module_filter_fn(module, fqn)`` is true, building each module's plan now. Parameters
    are reused, not copied, so an optimizer built before the swap still holds them.
    ``recipe=None`` leaves the recipe to ``hd.autocast``. Returns ``model`` (or the new
    module if ``model`` itself is a Linear).

    ``quantized_weights=True`` (needs ``recipe``) also turns each converted weight into a
    QuantizedTensor parameter made by the recipe's weight quantizer, as
    ``hd.quantized_model_init`` creates them: new parameters, so build the optimizer after
    converting. With ``keep_high_precision_init`` (the default) each keeps its current
    values in fp32 for ``MasterWeightOptimizer``'s master, also through ``fully_shard``
    (``hp_init``): the weights are those ``quantized_model_init(recipe)`` makes from the same
    values, and sharded training is bitwise the unsharded training. A weight shared
    with another module (tied embeddings) stays high precision (warned once), since
    quantizing it would untie it.
    """
    if recipe is not None and not isinstance(recipe, Recipe):
        raise ValueError(f"convert_to_hybrid: recipe must be an hd.Recipe or None, got {type(recipe).__name__}")
    if quantized_weights and recipe is None:
        raise ValueError("convert_to_hybrid: quantized_weights=True needs a recipe (its weight quantizer makes "
                         "the weights); pass recipe=hd.recipe_from_name(...)")
    shared = _shared_parameter_ids(model) if quantized_weights else set()

    def swap(mod: nn.Module, fqn: str) -> nn.Module:
        if not isinstance(mod, (nn.Linear, Linear)):
            return mod
        if module_filter_fn is not None and not module_filter_fn(mod, fqn):
            return mod
        new = mod if isinstance(mod, Linear) else _linear_from(mod)
        new.use_recipe(recipe, name=fqn)  # plans (and their states) now, before any compile
        if quantized_weights:
            _quantize_weight(new, fqn, shared=id(new.weight) in shared,
                             keep_high_precision_init=keep_high_precision_init)
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


def _shared_parameter_ids(model: nn.Module) -> set[int]:
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {k for k, n in seen.items() if n > 1}


def _linear_from(mod: nn.Linear) -> Linear:
    """An ``hd.Linear`` holding ``mod``'s parameters (not copies)."""
    new = Linear.__new__(Linear)
    nn.Module.__init__(new)
    new.in_features, new.out_features = mod.in_features, mod.out_features
    new._plans, new._last_recipe = {}, None
    new.weight, new.bias = mod.weight, mod.bias
    return new


def _quantize_weight(mod: Linear, fqn: str, *, shared: bool, keep_high_precision_init: bool) -> None:
    w = mod.weight
    if isinstance(w, QuantizedTensor):
        return
    name = f"{fqn}.weight" if fqn else "weight"
    if shared:
        warn_once(f"hd.convert_to_hybrid: {name} is shared with another module (tied weights); it stays high "
                  "precision (quantized on the fly each step), since a quantized copy would untie it.",
                  key="convert_to_hybrid: tied weight")
        return
    init = w.detach().to(torch.float32, copy=True) if keep_high_precision_init else None  # w stays the caller's
    mod.weight = quantized_weight_parameter(w, mod.plan_for(mod.recipe).weight, init=init,
                                            requires_grad=w.requires_grad)


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
