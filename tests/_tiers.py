"""The two tiers of the test suite.

The fast tier is the README's test command (``pytest -n 2``; ``pyproject.toml`` adds
``-m "not slow"``): every module, every format and every parallel layout, with the
multi-rank training tests run on ``FAST_RECIPES``. The slow tier (``pytest -m slow``) holds
the rest of that matrix: the other recipes of each multi-rank training test, the Triton
interpreter checks and the longer launcher variants. It is CPU-only; run it apart from
the GPU tier (``pytest -m gpu``), whose timing-sensitive tests do not share a loaded host.
"""

from __future__ import annotations

import pytest

import hybrid_dist as hd

# a hybrid recipe whose backward is NVFP4 (RHT, stochastic rounding) and whose forward is
# MXFP8, and the stateful per-tensor FP8 recipe (amax history): between them every storage
# kind, the scale state and the random state that training carries
FAST_RECIPES = ("fp8_delayed", "mxfp8_fwd_nvfp4_bwd")
slow = pytest.mark.slow


def by_recipe(names=hd.RECIPE_NAMES, fast=FAST_RECIPES) -> list:
    """One pytest param per name (a recipe's, or any test id with its own ``fast`` set);
    names outside ``fast`` are marked slow."""
    return [pytest.param(n, marks=() if n in fast else slow) for n in names]


def recipe_groups(names=hd.RECIPE_NAMES, fast=FAST_RECIPES) -> list:
    """Two params for a test that runs several recipes in one multi-rank job (one process
    start-up for all): ``fast`` (the names in ``fast``) and ``rest`` (marked slow)."""
    names = list(names)
    return [pytest.param([n for n in names if n in fast], id="fast"),
            pytest.param([n for n in names if n not in fast], id="rest", marks=slow)]


def is_fast_group(names, fast=FAST_RECIPES) -> bool:
    """Whether ``names`` is ``recipe_groups``' fast group (for configurations a test adds
    per tier)."""
    return set(names) <= set(fast)
