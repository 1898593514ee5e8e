"""Expert parallel: all-to-all dispatch and combine of token slots over an EP group.

Legend: W ranks in the EP group, E global experts, ``E_l = E / W`` local experts (rank r
owns experts ``[r·E_l, (r+1)·E_l)``), S = T·k slots on this rank, R slots received.

[Note: exchange layout]
Slots leave ``permute`` sorted by global expert, so the rows for rank d are contiguous
(``send_splits[d] = Σ_{e of d} count[e]``). ``all_to_all_single`` delivers them
source-major, ``[src 0: e_0, e_1, ...][src 1: e_0, ...]``; ``regroup`` reorders them
expert-major, ``[e_0: src 0, src 1, ...][e_1: ...]``, so expert e sees its tokens in
global (rank, token) order — exactly the rows a single rank would give it.

Per step: one ``all_to_all_single`` of the ``[E]`` counts; the forward token payload
(dispatch) and the combine's backward payload (dy) each need one ``all_reduce`` (MAX) of
an ``[E]`` amax vector when their format has a per-tensor scale, then one
``all_to_all_single`` of packed bytes (``_wire``); the combine forward and the dispatch
backward exchange high precision (they are summed, not multiplied). The sender quantizes
all its slots in one pass whatever E (``_wire.quantize_slots``: per-tensor formats scale
each row by its expert's scale), so its launches and host time do not grow with E.

Which payloads travel quantized (``_wire.unsupported_reason``): the rowwise direction of
formats whose blocks run along K (per token), with a per-tensor scale from the all-reduced
amax. The columnwise (wgrad) direction blocks along tokens from several source ranks, so
the receiver makes it from the received rows: the rowwise bits transposed (per-tensor FP8
with one quantizer both ways: bitwise the high-precision exchange), or the columnwise
quantization of the rows' dequantized values where both directions are power-of-two
block formats (MXFP8, FP8 blocks: "send rowwise, make the columnwise after"). That one
is not bitwise: each element is the columnwise quantization of a value within the rowwise
quantization error of x; it equals the high-precision path's wherever the element is in
the normal range of its row and column blocks and is otherwise within half the sum of the
two directions' grid steps (``_wire`` module doc; measured in
``tests_distributed/test_moe_ep_columnwise.py``). So MXFP8 sends ``K + K/32`` bytes per
token row (0.52× bf16) in training too, and so does ``mxfp8_fwd_nvfp4_bwd``'s x, whose
NVFP4 columnwise the receiver quantizes per expert from the MXFP8 values (dW's SQNR
~0.15 dB below the high-precision exchange's; ``_wire``). Delayed scaling travels
quantized too: the exchange advances the local experts' states, all-gathers their scales
(``[E]`` floats) and records the all-reduced amax in them, so rows, scales and histories
are bitwise those of quantizing after a high-precision exchange. The rest exchange high precision and quantize
after (warned once): an NVFP4 rowwise under a columnwise made at the receiver (``nvfp4``'s
x), an identity columnwise under a quantized rowwise (``fp8_fwd_bf16_bwd``'s x: its bf16
rows are the wgrad operand, cheapest sent alone), and NVFP4 stochastic rounding in the
sent direction (both NVFP4 recipes' dy: the expert's generator draws).

At the receiver, the rows become the experts' per-expert storages (``GroupedQuantized``,
the reference GEMM loop), or, where the expert layer takes the packed CUDA path
(``GroupedLinear.packed_exchange``: per-tensor FP8, or a requantized block format such as
MXFP8), are placed straight into that path's packed layout (``io["x_packed"]`` /
``io["dy_packed"]``), read in arrival order through the regroup index (no expert-major
copy first): FP8 codes with their transpose (``device_split.packed_fp8_rows``),
block-format wire rows as they are, then the columnwise requantized for all local experts
in one call (``device_split.place_rows``; NVFP4's per expert). Either way the rowwise
direction, and a columnwise one derived from its bits, is bitwise that of exchanging high
precision. No dequantized copy is made for autograd: the tensor the graph carries between
the exchange and the experts (forward rows, backward dy) is a broadcast stand-in.

Host syncs: one a layer and step (``make_route``: the sent and received counts, read together
for ``all_to_all_single``'s split sizes); the regroup index is built on the device.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from hybrid_dist.amax_sync import all_reduce_amaxes
from hybrid_dist.formats.float8 import Float8Quantizer, advance_stacked, stacked_delayed_states
from hybrid_dist.moe.exchange_io import ExchangeIO
from hybrid_dist.recipe_module import in_backward
from hybrid_dist.warn import warn_once
from hybrid_dist.moe import _wire, device_split
from hybrid_dist.moe.packed_index import IndexCache, packed_index
from hybrid_dist.moe.split_quantize import GroupedQuantized

__all__ = ["WireStats", "Route", "make_route", "dispatch", "combine", "combine_io"]


@dataclasses.dataclass
class WireStats:
    """Bytes each rank sends to **other** ranks, by exchange (``counts``, ``dispatch``,
    ``combine``, ``dispatch_grad``, ``combine_grad``, ``amax``)."""

    bytes: dict[str, int] = dataclasses.field(default_factory=dict)

    def add(self, key: str, n: int) -> None:
        self.bytes[key] = self.bytes.get(key, 0) + int(n)


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


def make_route(tokens_per_expert: torch.Tensor, group, stats: WireStats | None) -> Route:
    """Exchange the counts and plan the step (one ``all_to_all_single``, one host read)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    e = tokens_per_expert.numel()
    if e % world:
        raise ValueError(f"{e} experts cannot be split over an EP group of {world} ranks; use a multiple")
    e_l = e // world
    recv = torch.zeros_like(tokens_per_expert)
    dist.all_to_all_single(recv, tokens_per_expert.contiguous(), group=group)
    if stats is not None:
        stats.add("counts", (world - 1) * e_l * tokens_per_expert.element_size())
    both = torch.cat([tokens_per_expert.reshape(-1), recv.reshape(-1)]).tolist()  # the host read (module note)
    counts, recv_counts = both[:e], [both[e + s * e_l:e + (s + 1) * e_l] for s in range(world)]
    rows = sum(both[e:])
    slots = packed_index(tokens_per_expert, sum(counts), 1)
    tokens_per_local_expert = recv.reshape(world, e_l).sum(0)
    return Route(
        group=group, rank=rank, world=world, counts_global=counts, slot_expert=slots.eid, slot_offsets=slots.offsets,
        send_splits=[sum(counts[d * e_l:(d + 1) * e_l]) for d in range(world)],
        recv_counts=recv_counts, recv_splits=[sum(r) for r in recv_counts],
        regroup=_regroup(recv, world, e_l, rows), tokens_per_local_expert=tokens_per_local_expert,
        local_splits=[sum(recv_counts[s][j] for s in range(world)) for j in range(e_l)],
        index=IndexCache(tokens_per_local_expert, rows),
    )


def _regroup(recv: torch.Tensor, world: int, e_l: int, rows: int) -> torch.Tensor:
    """``[rows]`` int64: expert-major row i = source-major row ``regroup[i]`` (note "exchange
    layout"), built on the device from the received counts ``recv [W·E_l]`` (no host copy)."""
    cnt = recv.reshape(-1).to(torch.int64)
    src_start = (cnt.cumsum(0) - cnt).reshape(world, e_l).t().reshape(-1)  # each block's first arriving row
    blocks = packed_index(cnt.reshape(world, e_l).t().reshape(-1), rows, 1)  # blocks in expert-major order
    return blocks.dest - blocks.offsets[blocks.eid] + src_start[blocks.eid]


def _a2a(x: torch.Tensor, in_splits, out_splits, route: Route, stats, key: str) -> torch.Tensor:
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=route.group)
    if stats is not None:
        row = torch.Size(x.shape[1:]).numel() * x.element_size()
        stats.add(key, (sum(in_splits) - in_splits[route.rank]) * row)
    return out


def _to_expert_major(x, route: Route):
    return x[route.regroup]


def _to_source_major(x, route: Route):
    out = torch.empty_like(x)
    out[route.regroup] = x
    return out


class _Exchange(torch.autograd.Function):
    """High-precision exchange: dispatch (``to_experts=True``: slots → experts) or combine."""

    @staticmethod
    def forward(ctx, x, route: Route, to_experts: bool, stats, key: str):
        ctx.route, ctx.to_experts, ctx.stats, ctx.key = route, to_experts, stats, key
        return _exchange(x, route, to_experts, stats, key)

    @staticmethod
    def backward(ctx, g):
        dx = _exchange(g.contiguous(), ctx.route, not ctx.to_experts, ctx.stats, ctx.key + "_grad")
        return dx, None, None, None, None


def _exchange(x, route: Route, to_experts: bool, stats, key: str):
    if to_experts:
        return _to_expert_major(_a2a(x, route.send_splits, route.recv_splits, route, stats, key), route)
    return _a2a(_to_source_major(x, route), route.recv_splits, route.send_splits, route, stats, key)


def quantized_exchange(x_perm, route: Route, quantizer, *, multiple: int, need_columnwise: bool,
                       stats, key: str, packed_multiple: int | None = None, values: bool = True,
                       states=None, advance: bool = True):
    """Send the slots' rowwise direction in ``quantizer``'s format (``_wire``: one quantize
    pass over all slots) and build the experts' :class:`GroupedQuantized` (padded to
    ``multiple``) at the receiver; with ``packed_multiple`` (``grouped_quantized.
    exchange_packable``), their ``device_split.PackedSplit`` for the sync-free grouped GEMMs
    instead. Delayed scaling needs ``states``, this rank's local experts' states of the
    quantizer's role: advanced first (unless ``advance=False``: an activation recompute),
    then their scales quantize every sender's rows and the step's amax is recorded in them
    (``_wire`` module doc). Returns that and the received rows' values ``[R, K]`` in x's
    dtype (expert-major), or None without ``values``."""
    e = len(route.counts_global)
    e_l = e // route.world
    x = x_perm.detach()
    row_q = quantizer.direction_quantizer("rowwise")
    amax = None
    if row_q.is_per_tensor:  # one MAX all-reduce of the [E] per-expert amaxes
        amax = all_reduce_amaxes(device_split.expert_amaxes(x, route.slot_expert, e), [route.group])
        if stats is not None:
            stats.add(key + "_amax", amax.numel() * amax.element_size())  # all-reduce payload
    first = route.rank * e_l  # this rank's first global expert
    scale = _delayed_scales(row_q, states, amax[first:first + e_l] if amax is not None else None, route,
                            advance, stats, key)
    slots = _wire.quantize_slots(quantizer, x, route.slot_expert, route.slot_offsets, amax, scale)
    recv = _a2a(_wire.pack(slots), route.send_splits, route.recv_splits, route, stats, key)  # source-major
    if packed_multiple is not None and row_q.is_per_tensor:  # FP8: a wire row is its K codes; scales known here
        scale_inv = slots.scale_inv[first:first + e_l]
        g = device_split.packed_fp8_rows(recv.view(row_q.dtype), scale_inv, route.tokens_per_local_expert,
                                         packed_multiple, columnwise=need_columnwise, src=route.regroup,
                                         index=route.index)
        return g, (_packed_values(g, x.dtype) if values else None)
    if packed_multiple is not None:
        if values:
            raise ValueError("quantized_exchange: packed block-format rows come without values")
        return _packed_block_rows(recv, slots, quantizer, route, packed_multiple, need_columnwise, x.dtype), None
    recv = _to_expert_major(recv, route)
    padded = [-(-m // multiple) * multiple for m in route.local_splits]
    index = route.index.get(multiple)  # offsets and each received row's padded row
    rows_all = _wire.unpack(recv, slots, index.dest, sum(padded))
    starts = [sum(padded[:j]) for j in range(len(padded))]
    rows = [_wire.expert_rows(rows_all, first + j, s, p) for j, (s, p) in enumerate(zip(starts, padded))]
    cols = (receiver_columnwise(quantizer, rows_all, rows, list(zip(starts, padded)), x.dtype) if need_columnwise
            else [None] * len(rows))
    g = GroupedQuantized(rowwise=rows, columnwise=cols, splits=list(route.local_splits), padded_splits=padded,
                         offsets=index.offsets, padded_offsets=index.padded_offsets)
    if not values:
        return g, None
    return g, torch.cat([st.dequantize(x.dtype)[:m] for st, m in zip(rows, route.local_splits)])


def _delayed_scales(row_q, states, local_amax, route: Route, advance: bool, stats, key: str):
    """Delayed scaling: every global expert's scale ``[E]`` (None for other scalings), with
    this rank's local expert states advanced (``advance``) and ``local_amax [E_l]`` recorded."""
    if not (isinstance(row_q, Float8Quantizer) and row_q.scaling == "delayed"):
        return None
    if states is None or len(states) != len(local_amax):
        raise AssertionError(f"quantized_exchange: delayed scaling needs {len(local_amax)} local expert states")
    if advance:
        advance_stacked(states, row_q)
    hist, local = stacked_delayed_states(states, local_amax.device)  # the states' own rows
    scale = local.new_empty(route.world * local.numel())
    dist.all_gather_into_tensor(scale, local.contiguous(), group=route.group)
    if stats is not None:
        stats.add(key + "_scale", local.numel() * local.element_size() * (route.world - 1))
    torch.maximum(hist[:, 0], local_amax, out=hist[:, 0])  # = states[i].record(local_amax[i])
    return scale


def _packed_block_rows(recv, slots, quantizer, route: Route, multiple: int, need_columnwise: bool, dtype):
    """The packed split of received block-format rows (MXFP8, FP8 1×128: no per-tensor
    field): the wire rows placed as they are, the columnwise requantized from their values
    in one call over all local experts (``receiver_columnwise``: every expert's padded
    segment is a multiple of the columnwise block, so the bytes are the per-expert ones);
    an NVFP4 columnwise, whose global scale is per expert, per expert
    (``device_split.placed_columnwise`` of the placed rows' values). ``recv``: source-major,
    read through the route's regroup."""
    placed, _, g = device_split.place_rows(recv, route.tokens_per_local_expert, multiple, src=route.regroup,
                                           index=route.index)
    rows = _wire.split_fields(placed, slots)
    col = (device_split.placed_columnwise(rows.dequantize(dtype), g, quantizer.direction_quantizer("columnwise"))
           if need_columnwise else None)
    return dataclasses.replace(g, rowwise=rows.tensors(), columnwise=col)


def receiver_columnwise(quantizer, rows_all, rows: list, spans: list[tuple[int, int]], dtype) -> list:
    """Each local expert's columnwise storage ``[K, p_e]`` made from its received rows
    (``_wire.columnwise_of``): ``rows_all`` every expert's padded rows, ``rows`` the
    experts' views of it, ``spans`` their ``(start, p_e)``. A requantized format whose
    columnwise blocks (along tokens) fit every padded segment quantizes all experts in one
    call: no block spans two experts, so each expert's part is its own quantization (not
    for a per-tensor columnwise such as NVFP4's global scale, which is per expert)."""
    if _wire.requantized_columnwise(quantizer):
        cq = quantizer.direction_quantizer("columnwise")
        block = cq.block_shape("columnwise")[0]
        if spans and not cq.is_per_tensor and all(s % block == 0 and p % block == 0 for s, p in spans):
            _, col = cq.quantize_storages(rows_all.dequantize(dtype), rowwise=False, columnwise=True)
            return [col.narrow_dim0(s, p).map_tensors(torch.Tensor.contiguous) for s, p in spans]
    derived = _wire.derivable_columnwise(quantizer)
    return [_wire.columnwise_of(quantizer, st, None if derived else st.dequantize(dtype)) for st in rows]


def _packed_values(g: device_split.PackedSplit, dtype) -> torch.Tensor:
    """The received rows' values ``[R, K]`` (expert order) of a packed FP8 split."""
    data, scale_inv = g.rowwise["data"], g.rowwise["scale_inv"]
    codes = data.view(torch.uint8).index_select(0, g.dest).view(data.dtype)
    return (codes.float() * scale_inv[g.row_expert.index_select(0, g.dest)][:, None]).to(dtype)


def _rows_stand_in(g, like: torch.Tensor) -> torch.Tensor:
    """``[R, K]`` zeros standing for the received rows in the autograd graph: the experts read
    the rows from ``io`` (note in ``dispatch``). A broadcast view: no memory, no kernel."""
    rows = g.dest.numel() if isinstance(g, device_split.PackedSplit) else sum(g.splits)
    return like.new_zeros(()).expand(rows, like.shape[1])


class _QuantizedDispatch(torch.autograd.Function):
    """Forward: quantized slots → experts (fills ``io["x_quantized"]`` / ``"x_packed"``);
    returns the rows' stand-in (``_rows_stand_in``). Backward: high-precision dx back to the
    slots."""

    @staticmethod
    def forward(ctx, x_perm, route, quantizer, multiple, need_columnwise, io, stats, packed, states):
        g, _ = quantized_exchange(x_perm, route, quantizer, multiple=multiple, need_columnwise=need_columnwise,
                                  stats=stats, key="dispatch", packed_multiple=packed, values=False,
                                  states=states, advance=not in_backward())
        io["x_packed" if packed is not None else "x_quantized"] = g
        ctx.route, ctx.stats = route, stats
        return _rows_stand_in(g, x_perm)

    @staticmethod
    def backward(ctx, dx):
        return _exchange(dx.contiguous(), ctx.route, False, ctx.stats, "dispatch_grad"), *([None] * 8)


class _QuantizedCombine(torch.autograd.Function):
    """Forward: high-precision expert outputs back to the slots. Backward: dy slots sent
    in the experts' gradient format (fills ``io["dy_quantized"]`` / ``"dy_packed"`` before
    the experts' backward runs, which reads dy from there); returns the rows' stand-in."""

    @staticmethod
    def forward(ctx, y_local, route, quantizer, multiple, io, stats, states):
        ctx.route, ctx.q, ctx.multiple, ctx.io, ctx.stats, ctx.states = route, quantizer, multiple, io, stats, states
        return _exchange(y_local, route, False, stats, "combine")

    @staticmethod
    def backward(ctx, dy):
        packed = ctx.io.get("packed")  # the last GroupedLinear took the packed path (combine_io)
        g, _ = quantized_exchange(dy.contiguous(), ctx.route, ctx.q, multiple=ctx.multiple, need_columnwise=True,
                                  stats=ctx.stats, key="combine_grad", packed_multiple=packed, values=False,
                                  states=ctx.states)
        ctx.io["dy_packed" if packed is not None else "dy_quantized"] = g
        return _rows_stand_in(g, dy), *([None] * 6)


def _warn_once(reason: str) -> None:
    warn_once(f"expert parallel: exchanging high precision and quantizing after, because {reason}", stacklevel=4)


def dispatch(x_perm, route: Route, *, plan=None, need_columnwise: bool = True, stats=None,
             packed: int | None = None):
    """Slots → local experts (expert-major rows). With a quantized ``plan`` (the first
    GroupedLinear's) whose input format allows it, the payload travels quantized; returns
    ``(x_local, io)`` where ``io`` feeds ``GroupedLinear.forward(io=...)`` (None: HP). With
    ``io``, the rows are in ``io`` and ``x_local`` is their stand-in (broadcast zeros of the
    rows' shape): it carries the gradient path, and only that GroupedLinear may consume it.
    ``packed``: the GroupedLinear's packed padding multiple when it takes the packed path
    (``GroupedLinear.packed_exchange``): the received rows arrive as ``io["x_packed"]``."""
    reason = _quantized_reason(plan, "input", need_columnwise)
    if reason is None:
        io = ExchangeIO(index=route.index)
        x = _QuantizedDispatch.apply(x_perm, route, plan.input, plan.multiple, need_columnwise, io, stats, packed,
                                     plan.states["input"])
        return x, io
    if plan is not None and reason != "identity":
        _warn_once(reason)
    return _Exchange.apply(x_perm, route, True, stats, "dispatch"), None


def combine_io(plan, packed: int | None = None, index: IndexCache | None = None) -> ExchangeIO | None:
    """The ``io`` to give the last GroupedLinear when its dy will arrive quantized
    (None: high precision; also for ``plan=None``); ``packed`` as for ``dispatch`` (dy then
    arrives as ``io["dy_packed"]``); ``index`` the route's (``Route.index``)."""
    if plan is None or _quantized_reason(plan, "grad_output", True) is not None:
        return None
    return ExchangeIO(index=index) if packed is None else ExchangeIO(packed=packed, index=index)


def combine(y_local, route: Route, *, plan=None, io: ExchangeIO | None = None, stats=None):
    """Local expert outputs → slots (high precision). With ``io = combine_io(plan)`` (also
    given to the last GroupedLinear's forward), the backward payload dy travels in that
    GroupedLinear's gradient format and fills ``io["dy_quantized"]`` for its backward."""
    if io is not None:
        return _QuantizedCombine.apply(y_local, route, plan.grad_output, plan.multiple, io, stats,
                                       plan.states["grad_output"])
    reason = _quantized_reason(plan, "grad_output", True)
    if plan is not None and reason not in (None, "identity"):
        _warn_once(reason)
    return _Exchange.apply(y_local, route, False, stats, "combine")


def _quantized_reason(plan, tensor_type: str, need_columnwise: bool) -> str | None:
    if plan is None:
        return "no recipe"
    q = getattr(plan, tensor_type)
    if all(isinstance(q.direction_quantizer(d), _wire.IdentityQuantizer) for d in ("rowwise", "columnwise")):
        return "identity"
    reason = _wire.unsupported_reason(q, need_columnwise=need_columnwise)
    return None if reason is None else f"the {tensor_type} format: {reason}"
