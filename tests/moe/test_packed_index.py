"""``moe.packed_index``: the packed layout's index against a loop over experts, the
``IndexCache`` building once per padding multiple, and ``split_quantize_packed`` /
``place_rows`` given a cache equal to building their own."""

from __future__ import annotations

import math

import pytest
import torch

import hybrid_dist as hd
from hybrid_dist.moe import GroupedLinear, device_split
from hybrid_dist.moe import packed_index as pi
from tests._helpers import assert_bitwise_equal


def _loop_index(counts: list[int], multiple: int):
    """The index by hand: expert e's rows go to its padded segment in order."""
    padded = [-(-m // multiple) * multiple for m in counts]
    cap = pi.packed_capacity(sum(counts), len(counts), multiple)
    eid, dest, row_expert = [], [], []
    start = 0
    for e, (m, p) in enumerate(zip(counts, padded)):
        eid += [e] * m
        dest += list(range(start, start + m))
        row_expert += [e] * p
        start += p
    row_expert += [len(counts)] * (cap - start)
    cum = lambda v: [sum(v[:i]) for i in range(len(v) + 1)]  # noqa: E731
    return cum(counts), cum(padded), eid, dest, row_expert, cap


@pytest.mark.parametrize("counts,multiple", [([37, 0, 90, 22, 1], 16), ([0, 5, 0, 300, 0], 128), ([4], 1),
                                             ([0, 0], 16), ([16, 16, 17], 32)])
def test_index_equals_a_loop_over_experts(counts, multiple):
    idx = pi.packed_index(torch.tensor(counts), sum(counts), multiple)
    off, poff, eid, dest, row_expert, cap = _loop_index(counts, multiple)
    assert (idx.rows, idx.capacity, idx.multiple) == (sum(counts), cap, multiple)
    for name, want in (("offsets", off), ("padded_offsets", poff), ("eid", eid), ("dest", dest),
                       ("row_expert", row_expert)):
        got = getattr(idx, name)
        assert got.dtype == torch.int64, name
        assert got.tolist() == want, f"{name} of {counts} at multiple {multiple}"


def test_cache_builds_once_per_multiple(monkeypatch):
    built = []
    real = pi.packed_index
    monkeypatch.setattr(pi, "packed_index", lambda *a: built.append(a[2]) or real(*a))
    counts = torch.tensor([3, 0, 40])
    cache = pi.IndexCache(counts, 43)
    first = cache.get(16)
    assert cache.get(16) is first and cache.get(32) is not first and cache.get(32).multiple == 32
    assert built == [16, 32]
    assert cache.serves(counts, 43)
    assert not cache.serves(counts.clone(), 43) and not cache.serves(counts, 42)
    assert pi.IndexCache.serving(cache, counts, 43) is cache
    assert pi.IndexCache.serving(cache, counts, 42) is None and pi.IndexCache.serving(None, counts, 43) is None


@pytest.mark.parametrize("recipe_name", ["fp8_current", "mxfp8"])
def test_split_with_a_cache_equals_without(recipe_name):
    recipe = hd.recipe_from_name(recipe_name)
    q = GroupedLinear(4, 64, 64, recipe=recipe).plan(recipe).grad_output
    counts = torch.tensor([5, 0, 33, 12])
    x = torch.randn(50, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    cache = pi.IndexCache(counts, 50)
    want = device_split.split_quantize_packed(x, counts, q, multiple=32)
    got = device_split.split_quantize_packed(x, counts, q, multiple=32, index=cache)
    assert got.dest is cache.get(32).dest  # the cache's tensors, not new ones
    for field in ("offsets", "padded_offsets", "dest", "row_expert"):
        assert_bitwise_equal(getattr(got, field), getattr(want, field), field)
    for direction in ("rowwise", "columnwise"):
        for name, t in getattr(want, direction).items():
            assert_bitwise_equal(getattr(got, direction)[name], t, f"{recipe_name} {direction} {name}")
    other = pi.IndexCache(counts.clone(), 50)  # another tensor: the cache does not serve it
    got = device_split.split_quantize_packed(x, counts, q, multiple=32, index=other)
    assert got.dest is not other.get(32).dest
    rows = torch.randint(0, 255, (50, 8), dtype=torch.uint8)
    placed, _, g = device_split.place_rows(rows, counts, 32, index=cache)
    assert g.row_expert is cache.get(32).row_expert
    assert_bitwise_equal(placed, device_split.place_rows(rows, counts, 32)[0], "place_rows with the cache")


@pytest.mark.parametrize("world,e_l", [(1, 3), (2, 2), (4, 2), (3, 1)])
def test_regroup_is_built_on_the_device_as_the_exchange_layout(world, e_l):
    """``route._regroup``: expert-major row i is source-major row ``regroup[i]``,
    the index a loop over (expert, source) blocks builds, with empty blocks."""
    from hybrid_dist.moe.route import _regroup

    g = torch.Generator().manual_seed(world * 10 + e_l)
    recv = torch.randint(0, 5, (world * e_l,), generator=g)
    recv[1 % recv.numel()] = 0
    counts = recv.reshape(world, e_l).tolist()
    starts, pos = {}, 0
    for s in range(world):
        for j in range(e_l):
            starts[s, j], pos = pos, pos + counts[s][j]
    want = [starts[s, j] + i for j in range(e_l) for s in range(world) for i in range(counts[s][j])]
    got = _regroup(recv, world, e_l, pos)
    assert got.dtype == torch.int64 and got.tolist() == want, f"W={world} E_l={e_l} counts {counts}"


def test_capacity_bounds_the_padded_rows_in_whole_granules():
    """C ≥ Σ ⌈m_e/b⌉·b for any split of T rows, and a multiple of ``CAPACITY_ROWS`` and of b:
    one row class for the kernels over the packed buffer whatever the routing."""
    gen = torch.Generator().manual_seed(0)
    for multiple in (1, 16, 32, 128):
        for rows in (0, 1, 424, 1024, 1025, 5000):
            cap = pi.packed_capacity(rows, 8, multiple)
            assert cap % pi.CAPACITY_ROWS == 0 and cap % multiple == 0, (rows, multiple, cap)
            assert cap < rows + 8 * (multiple - 1) + math.lcm(multiple, pi.CAPACITY_ROWS), (rows, multiple, cap)
            for _ in range(20):
                counts = torch.multinomial(torch.ones(8), rows, replacement=True, generator=gen).bincount(
                    minlength=8) if rows else torch.zeros(8, dtype=torch.int64)
                assert int((-(-counts // multiple) * multiple).sum()) <= cap, (counts.tolist(), multiple, cap)


def test_capacity_rows_cover_the_default_mxfp8_columnwise_tile():
    """The packed buffer's row count is a multiple of the default MXFP8 words kernel's tile
    rows, so that kernel runs in one form whatever the routing (module doc)."""
    from hybrid_dist.kernels.mxfp8.configs import MXFP8_WORDS_DEFAULT

    assert pi.CAPACITY_ROWS % MXFP8_WORDS_DEFAULT.bm == 0
