"""The quantized dispatch makes one quantize pass over all slots: on the fake process group
(EP = E/2, so each rank holds 2 experts whatever E), the torch ops one ``dispatch`` runs are
the same for E = 4 and E = 16 global experts, with one ``quantize_storages`` call at most on
the sender (plus one for all local experts where the receiver requantizes the columnwise), and the
tensor the dispatch hands autograd is a stand-in (no dequantized copy of the rows)."""

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

import hybrid_dist as hd
from hybrid_dist.formats import Quantizer
from hybrid_dist.moe import GroupedLinear
from hybrid_dist.moe import expert_parallel as ep

H, E_LOCAL, SLOTS = 128, 2, 96


class _OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _dispatch_ops(recipe_name, num_experts, need_columnwise, monkeypatch):
    """(torch ops, quantize_storages calls) of one quantized dispatch on EP = E / 2."""
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=num_experts // E_LOCAL)
    try:
        recipe = hd.recipe_from_name(recipe_name)
        plan = GroupedLinear(E_LOCAL, H, H, recipe=recipe).plan(recipe)
        x = torch.randn(SLOTS, H, dtype=torch.bfloat16)
        counts = torch.full((num_experts,), SLOTS // num_experts, dtype=torch.int64)
        route = ep.make_route(counts, dist.group.WORLD, None)
        calls = []
        quantize = Quantizer.quantize_storages
        monkeypatch.setattr(Quantizer, "quantize_storages", lambda self, *a, **k: calls.append(1) or quantize(self, *a, **k))
        with _OpCount() as mode:
            x_local, io = ep.dispatch(x, route, plan=plan, need_columnwise=need_columnwise)
        assert io is not None, f"{recipe_name}: the dispatch fell back to high precision"
        # no dequantized copy for autograd: the graph carries a broadcast stand-in of the rows
        assert x_local.stride() == (0, 0) and x_local.shape[1] == H, (recipe_name, x_local.stride())
        return mode.ops, len(calls)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("recipe_name,need_columnwise", [
    ("fp8_current", False), ("fp8_current", True), ("mxfp8", False), ("mxfp8", True), ("nvfp4", False),
    ("fp8_block", False), ("fp8_block", True)])
def test_dispatch_ops_do_not_grow_with_experts(recipe_name, need_columnwise, monkeypatch):
    cfg = f"{recipe_name} need_columnwise={need_columnwise}"
    (ops4, q4), (ops16, q16) = (_dispatch_ops(recipe_name, e, need_columnwise, monkeypatch) for e in (4, 16))
    assert len(ops4) == len(ops16) and ops4 == ops16, (
        f"{cfg}: one dispatch runs {len(ops4)} torch ops for E=4 but {len(ops16)} for E=16 (EP=E/2)")
    requantized = need_columnwise and recipe_name != "fp8_current"  # fp8_current: the transpose
    most = 1 + (1 if requantized else 0)  # the receiver requantizes all local experts at once
    assert q4 == q16 and q4 <= most, f"{cfg}: quantize_storages calls E=4: {q4}, E=16: {q16} (at most {most})"


def test_route_built_on_the_counts_device_under_another_default_device():
    """A model built under ``torch.set_default_device("cuda")`` leaves that default on: the
    route's host-side planning must not follow it (meta stands in for CUDA on CPU)."""
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        counts = torch.tensor([3, 0, 5, 2], dtype=torch.int64, device="cpu")
        with torch.device("meta"):
            route = ep.make_route(counts, dist.group.WORLD, None)
        assert route.regroup.device.type == "cpu" and route.slot_expert.device.type == "cpu", route
        assert route.recv_counts == [[3, 0], [5, 2]], route.recv_counts  # the fake group echoes the counts
    finally:
        dist.destroy_process_group()


def test_started_route_equals_the_route_and_checks_the_slot_count():
    """``finish_route(start_route(counts, num_slots=S))`` (the layer's order: the slots laid
    out before the host read) plans what ``make_route`` does; a wrong ``num_slots`` is named."""
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        counts = torch.tensor([3, 0, 5, 2], dtype=torch.int64)
        want = ep.make_route(counts, dist.group.WORLD, None)
        start = ep.start_route(counts, dist.group.WORLD, None, num_slots=10)
        assert start.slot_expert.tolist() == want.slot_expert.tolist(), "slots laid out before the host read"
        got = ep.finish_route(start)
        for field in ("counts_global", "send_splits", "recv_counts", "recv_splits", "local_splits"):
            assert getattr(got, field) == getattr(want, field), field
        for field in ("slot_expert", "slot_offsets", "regroup", "tokens_per_local_expert"):
            assert torch.equal(getattr(got, field), getattr(want, field)), field
        with pytest.raises(ValueError, match="given 11 slots, but the counts sum to 10"):
            ep.finish_route(ep.start_route(counts, dist.group.WORLD, None, num_slots=11))
    finally:
        dist.destroy_process_group()
