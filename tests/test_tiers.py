"""The two test tiers (``tests/_tiers.py``) split the recipe matrix without losing a recipe:
the fast tier's params and the slow tier's together name every recipe exactly once."""

import pytest

import hybrid_dist as hd
from tests._tiers import FAST_RECIPES, by_recipe, is_fast_group, recipe_groups


def _is_slow(param) -> bool:
    return any(m.name == "slow" for m in param.marks)


def test_fast_recipes_are_named_recipes():
    assert set(FAST_RECIPES) <= set(hd.RECIPE_NAMES), FAST_RECIPES


@pytest.mark.parametrize("names", [hd.RECIPE_NAMES, ("fp8_current", "nvfp4", "mxfp8_fwd_nvfp4_bwd")])
def test_by_recipe_marks_all_but_the_fast_recipes_slow(names):
    params = by_recipe(names)
    assert [p.values[0] for p in params] == list(names)
    slow = [p.values[0] for p in params if _is_slow(p)]
    assert slow == [n for n in names if n not in FAST_RECIPES], f"slow params {slow} for {names}"


@pytest.mark.parametrize("names", [hd.RECIPE_NAMES, ("fp8_current", "fp8_block", "nvfp4", "mxfp8_fwd_nvfp4_bwd")])
def test_recipe_groups_partition_the_names(names):
    fast, rest = recipe_groups(names)
    assert (fast.id, rest.id) == ("fast", "rest") and not _is_slow(fast) and _is_slow(rest)
    assert sorted(fast.values[0] + rest.values[0]) == sorted(names), (fast.values, rest.values)
    assert set(fast.values[0]) == set(names) & set(FAST_RECIPES), fast.values
    assert is_fast_group(fast.values[0]) and not is_fast_group(rest.values[0]), (fast.values, rest.values)
