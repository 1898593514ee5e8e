"""The expert-parallel step's exchange plan (``Route``) and the high-precision all-to-all.

Legend: W ranks in the EP group, E global experts, ``E_l = E / W`` local experts (rank r
owns experts ``[r·E_l, (r+1)·E_l)``), S = T·k slots on this rank, R slots received.

[Note: exchange layout]
Slots leave ``permute`` sorted by global expert, so the rows for rank d are contiguous
(``send_splits[d] = Σ_{e of d} count[e]``). ``all_to_all_single`` delivers them
source-major, ``[src 0: e_0, e_1, ...][src 1: e_0, ...]``; ``regroup`` reorders them
expert-major, ``[e_0: src 0, src 1, ...][e_1: ...]``, so expert e sees its tokens in
global (rank, token) order — exactly the rows a single rank would give it.

Per step: one ``all_to_all_single`` of the ``[E]`` counts, then one of the payload per
exchange. Host syncs: one a layer and step (the sent and received counts, read together
for ``all_to_all_single``'s split sizes); the regroup index is built on the device.
``make_route`` is ``finish_route(start_route(...))``: ``start_route`` exchanges the counts,
lays out the slots and starts the counts' copy to the host, so that work which needs no
host count (the sender's quantization of its slots) can be queued on the device before
``finish_route`` waits for the copy.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from hybrid_dist.moe.packed_index import IndexCache, packed_index

__all__ = ["WireStats", "Route", "RouteStart", "PendingRows", "make_route", "start_route", "finish_route",
           "all_to_all", "exchange", "exchange_to_slots_async", "to_expert_major", "to_source_major"]


@dataclasses.dataclass
class WireStats:
    """Bytes each rank sends to **other** ranks, by exchange (``counts``, ``dispatch``,
    ``combine``, ``dispatch_grad``, ``combine_grad``, ``amax``)."""

    bytes: dict[str, int] = dataclasses.field(default_factory=dict)

    def add(self, key: str, n: int) -> None:
        self.bytes[key] = self.bytes.get(key, 0) + int(n)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RouteStart:
    """A layer's exchange plan before the host read (``start_route``): what the device
    knows. The sender's payload needs only this (``group``, ``rank``, ``world``,
    ``num_experts``, ``slot_expert``, ``slot_offsets``, as a ``Route`` has them)."""

    group: dist.ProcessGroup
    rank: int
    world: int
    num_experts: int
    slot_expert: torch.Tensor | None  # [S] global expert of each slot (sorted), on device (None: S not given)
    slot_offsets: torch.Tensor | None  # [E+1] each global expert's first slot, on device
    tokens_per_expert: torch.Tensor  # [E] this rank's slots per global expert, on device
    recv: torch.Tensor  # [W·E_l] slots from each source per local expert, on device
    host_counts: torch.Tensor  # [E + W·E_l] both on the host once ``ready`` (pinned on CUDA)
    ready: object  # the copy's CUDA event, or None (a CPU copy, done)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Route:
    """One step's exchange plan (host split sizes + device regroup index)."""

    group: dist.ProcessGroup
    rank: int
    world: int
    counts_global: list[int]  # [E] this rank's slots per global expert
    slot_expert: torch.Tensor  # [S] global expert of each slot (sorted), on device
    slot_offsets: torch.Tensor  # [E+1] each global expert's first slot, on device
    send_splits: list[int]  # [W] slots to each rank
    recv_counts: list[list[int]]  # [W][E_l] slots from each source per local expert
    recv_splits: list[int]  # [W]
    regroup: torch.Tensor  # [R]: expert-major row i = source-major row regroup[i]
    tokens_per_local_expert: torch.Tensor  # [E_l] int64 on device
    local_splits: list[int]  # [E_l]
    index: IndexCache  # the received rows' packed index, per padding multiple (every consumer's)

    @property
    def num_experts(self) -> int:
        return len(self.counts_global)


def start_route(tokens_per_expert: torch.Tensor, group, stats: WireStats | None,
                num_slots: int | None = None) -> RouteStart:
    """Exchange the counts (one ``all_to_all_single``), lay out this rank's ``num_slots``
    slots (the permuted rows; None: laid out by ``finish_route`` from the host counts) and
    start the counts' copy to the host; nothing waits for the device."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    e = tokens_per_expert.numel()
    if e % world:
        raise ValueError(f"{e} experts cannot be split over an EP group of {world} ranks; use a multiple")
    recv = torch.zeros_like(tokens_per_expert)
    dist.all_to_all_single(recv, tokens_per_expert.contiguous(), group=group)
    if stats is not None:
        stats.add("counts", (world - 1) * (e // world) * tokens_per_expert.element_size())
    both = torch.cat([tokens_per_expert.reshape(-1), recv.reshape(-1)])
    ready = None
    if both.is_cuda:  # the one host read, started here and waited for in finish_route (module note)
        host = torch.empty(both.shape, dtype=both.dtype, device="cpu", pin_memory=True)  # not the default device
        host.copy_(both, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
    else:
        host = both
        if num_slots is not None:  # the counts are on the host already: check before laying out
            _check_slots(num_slots, int(tokens_per_expert.sum()))
    slots = packed_index(tokens_per_expert, num_slots, 1) if num_slots is not None else None
    return RouteStart(group=group, rank=rank, world=world, num_experts=e,
                      slot_expert=slots.eid if slots is not None else None,
                      slot_offsets=slots.offsets if slots is not None else None,
                      tokens_per_expert=tokens_per_expert, recv=recv, host_counts=host, ready=ready)


def finish_route(start: RouteStart) -> Route:
    """The host read of the counts (waits for ``start_route``'s copy) and the plan."""
    if start.ready is not None:
        start.ready.synchronize()
    both = start.host_counts.tolist()
    e, world = start.num_experts, start.world
    e_l = e // world
    counts, recv_counts = both[:e], [both[e + s * e_l:e + (s + 1) * e_l] for s in range(world)]
    rows = sum(both[e:])
    if start.slot_expert is None:
        slots = packed_index(start.tokens_per_expert, sum(counts), 1)
        start = dataclasses.replace(start, slot_expert=slots.eid, slot_offsets=slots.offsets)
    else:
        _check_slots(start.slot_expert.numel(), sum(counts))
    tokens_per_local_expert = start.recv.reshape(world, e_l).sum(0)
    return Route(
        group=start.group, rank=start.rank, world=world, counts_global=counts, slot_expert=start.slot_expert,
        slot_offsets=start.slot_offsets, send_splits=[sum(counts[d * e_l:(d + 1) * e_l]) for d in range(world)],
        recv_counts=recv_counts, recv_splits=[sum(r) for r in recv_counts],
        regroup=_regroup(start.recv, world, e_l, rows), tokens_per_local_expert=tokens_per_local_expert,
        local_splits=[sum(recv_counts[s][j] for s in range(world)) for j in range(e_l)],
        index=IndexCache(tokens_per_local_expert, rows),
    )


def _check_slots(num_slots: int, counted: int) -> None:
    if num_slots != counted:
        raise ValueError(f"start_route was given {num_slots} slots, but the counts sum to {counted}")


def make_route(tokens_per_expert: torch.Tensor, group, stats: WireStats | None) -> Route:
    """Exchange the counts and plan the step (one ``all_to_all_single``, one host read)."""
    return finish_route(start_route(tokens_per_expert, group, stats))


def _regroup(recv: torch.Tensor, world: int, e_l: int, rows: int) -> torch.Tensor:
    """``[rows]`` int64: expert-major row i = source-major row ``regroup[i]`` (note "exchange
    layout"), built on the device from the received counts ``recv [W·E_l]`` (no host copy)."""
    cnt = recv.reshape(-1).to(torch.int64)
    src_start = (cnt.cumsum(0) - cnt).reshape(world, e_l).t().reshape(-1)  # each block's first arriving row
    blocks = packed_index(cnt.reshape(world, e_l).t().reshape(-1), rows, 1)  # blocks in expert-major order
    return blocks.dest - blocks.offsets[blocks.eid] + src_start[blocks.eid]


class PendingRows:
    """Rows an asynchronous ``all_to_all`` is delivering: ``wait()`` orders the current
    stream after it and returns them. Holds the sent buffer until then."""

    def __init__(self, out: torch.Tensor, work, sent: torch.Tensor):
        self._out, self._work, self._sent = out, work, sent

    def wait(self) -> torch.Tensor:
        self._work.wait()
        self._sent = None
        return self._out


def all_to_all(x: torch.Tensor, in_splits, out_splits, route: Route, stats, key: str, *, async_op: bool = False):
    """``x``'s rows split ``in_splits`` to the group's ranks, ``out_splits`` from them (one
    ``all_to_all_single``); the bytes sent to other ranks counted under ``key``. With
    ``async_op`` a ``PendingRows``, else the rows."""
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    x = x.contiguous()
    work = dist.all_to_all_single(out, x, out_splits, in_splits, group=route.group, async_op=async_op)
    if stats is not None:
        row = torch.Size(x.shape[1:]).numel() * x.element_size()
        stats.add(key, (sum(in_splits) - in_splits[route.rank]) * row)
    return PendingRows(out, work, x) if async_op else out


def to_expert_major(x, route: Route):
    """Received rows, source-major as they arrive, in expert-major order (note above)."""
    return x[route.regroup]


def to_source_major(x, route: Route):
    """The inverse of ``to_expert_major``."""
    out = torch.empty_like(x)
    out[route.regroup] = x
    return out


def exchange(x, route: Route, to_experts: bool, stats, key: str):
    """High-precision exchange: slots to their experts' rows (``to_experts``, expert-major)
    or the experts' rows back to the slots."""
    if to_experts:
        return to_expert_major(all_to_all(x, route.send_splits, route.recv_splits, route, stats, key), route)
    return all_to_all(to_source_major(x, route), route.recv_splits, route.send_splits, route, stats, key)


def exchange_to_slots_async(x, route: Route, stats, key: str) -> PendingRows:
    """``exchange(x, route, False, ...)`` started asynchronously: the experts' rows back to
    the slots, delivered when the result's ``wait()`` is called."""
    return all_to_all(to_source_major(x, route), route.recv_splits, route.send_splits, route, stats, key,
                      async_op=True)
