"""Scoped recipe contexts: ``autocast`` (recipe for modules that have none) and
``quantized_model_init`` (parameters created as QuantizedTensors).

Both are context managers over a ``contextvars.ContextVar``: they change nothing outside
their ``with`` block and are safe across threads.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

from hybrid_dist.recipes import Recipe

_AUTOCAST: contextvars.ContextVar[Recipe | None] = contextvars.ContextVar("hd_autocast", default=None)
_MODEL_INIT: contextvars.ContextVar[tuple[Recipe, bool] | None] = contextvars.ContextVar(
    "hd_quantized_model_init", default=None
)


def _check_recipe(recipe, fn: str) -> None:
    if not isinstance(recipe, Recipe):
        raise ValueError(
            f"hd.{fn} expects an hd.Recipe (from hd.recipe_from_name or hd.CustomRecipe), got "
            f"{type(recipe).__name__}"
        )


@contextlib.contextmanager
def autocast(recipe: Recipe | None, *, enabled: bool = True) -> Iterator[None]:
    """Run ``hd.Linear`` modules without their own recipe under ``recipe``.

    ``enabled=False`` (or ``recipe=None``) runs them in high precision inside the block.
    """
    if recipe is not None:
        _check_recipe(recipe, "autocast")
    token = _AUTOCAST.set(recipe if enabled else None)
    try:
        yield
    finally:
        _AUTOCAST.reset(token)


def current_recipe() -> Recipe | None:
    return _AUTOCAST.get()


@contextlib.contextmanager
def quantized_model_init(recipe: Recipe, *, keep_high_precision_init: bool = True) -> Iterator[None]:
    """``hd.Linear`` weights created inside are QuantizedTensors made by ``recipe``'s
    weight quantizer (both directions).

    ``keep_high_precision_init``: keep the initial high-precision values on each parameter
    (``param._hd_hp_init``) so ``MasterWeightOptimizer`` starts its fp32 masters from them
    rather than from the dequantized weights; it frees them when it takes them.
    """
    _check_recipe(recipe, "quantized_model_init")
    token = _MODEL_INIT.set((recipe, keep_high_precision_init))
    try:
        yield
    finally:
        _MODEL_INIT.reset(token)


def model_init_recipe() -> tuple[Recipe, bool] | None:
    return _MODEL_INIT.get()
