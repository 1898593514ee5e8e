"""Scoped recipe contexts: ``autocast`` (recipe for modules that have none) and
``quantized_model_init`` (parameters created as QuantizedTensors).

Both are context managers over a ``contextvars.ContextVar``: they change nothing outside
their ``with`` block and are safe across threads.

[Note: autocast under torch.compile]
Dynamo cannot trace ``ContextVar.get`` (a graph break in every ``hd.Linear``, so compiled
blocks ran as many small graphs). ``autocast`` therefore also keeps a process-wide mirror
of the innermost recipe, which is what a trace reads (Dynamo guards on the recipe object,
so entering another recipe recompiles). Eager code reads the ContextVar. Compiled modules
run under *different* ``hd.autocast`` recipes in concurrent threads are not supported.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import torch

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
    active = recipe if enabled else None
    token = _AUTOCAST.set(active)
    _TRACED.append(active)
    try:
        yield
    finally:
        _TRACED.pop()
        _AUTOCAST.reset(token)


class _TracedAutocast(list):
    """The process-wide stack of active ``autocast`` recipes that traces read (see the note)."""

    def top(self) -> Recipe | None:
        return self[-1] if self else None


_TRACED = _TracedAutocast()


def current_recipe() -> Recipe | None:
    if torch.compiler.is_compiling():
        return _TRACED.top()
    return _AUTOCAST.get()


@contextlib.contextmanager
def quantized_model_init(recipe: Recipe, *, keep_high_precision_init: bool = True) -> Iterator[None]:
    """``hd.Linear`` weights created inside are QuantizedTensors made by ``recipe``'s
    weight quantizer (both directions).

    ``keep_high_precision_init``: keep the initial values in fp32 on each parameter
    (``hybrid_dist.hp_init``; they follow the parameter through ``.to``, ``fully_shard`` and the TP
    styles, row for row) so ``MasterWeightOptimizer`` starts its fp32 masters from them
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
