"""Token payloads sent in the expert layers' formats over an EP group (``route``), and
the experts' storages made from them at the receiver.

The forward token payload (dispatch) and the combine's backward payload (dy) each need one
``all_reduce`` (MAX) of an ``[E]`` amax vector when their format has a per-tensor scale,
then one ``all_to_all_single`` of packed bytes (``_wire``). The sender quantizes all its
slots in one pass whatever E (``_wire.quantize_slots``: per-tensor formats scale each row
by its expert's scale), so its launches and host time do not grow with E.

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
are bitwise those of quantizing after a high-precision exchange.

At the receiver, the rows become the experts' per-expert storages (``GroupedQuantized``,
the reference GEMM loop), or, where the expert layer takes the packed CUDA path
(``GroupedLinear.packed_exchange``: per-tensor FP8, or a requantized block format such as
MXFP8), are placed straight into that path's packed layout (``io["x_packed"]`` /
``io["dy_packed"]``), read in arrival order through the regroup index (no expert-major
copy first): FP8 codes with their transpose (``device_split.packed_fp8_rows``),
block-format wire rows as they are, then the columnwise requantized for all local experts
in one call (``device_split.place_rows``; NVFP4's per expert). Either way the rowwise
direction, and a columnwise one derived from its bits, is bitwise that of exchanging high
precision.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from hybrid_dist.amax_sync import all_reduce_amaxes
from hybrid_dist.formats.float8 import Float8Quantizer, advance_stacked, stacked_delayed_states
from hybrid_dist.moe import _wire, device_split
from hybrid_dist.moe.route import Route, RouteStart, all_to_all, to_expert_major
from hybrid_dist.moe.split_quantize import GroupedQuantized

__all__ = ["quantize_payload", "quantized_exchange", "receiver_columnwise"]


def quantize_payload(x_perm, layout: Route | RouteStart, quantizer, *, stats, key: str, states=None,
                     advance: bool = True):
    """The sender's half of ``quantized_exchange``: the slots' rowwise direction quantized
    for the wire (``_wire.quantize_slots``; per-tensor formats after one MAX all-reduce of
    the ``[E]`` per-expert amaxes). Needs only the device layout of the slots, so it can be
    queued before the host reads the counts (``route.start_route``)."""
    e = layout.num_experts
    e_l = e // layout.world
    x = x_perm.detach()
    row_q = quantizer.direction_quantizer("rowwise")
    amax = None
    if row_q.is_per_tensor:  # one MAX all-reduce of the [E] per-expert amaxes
        amax = all_reduce_amaxes(device_split.expert_amaxes(x, layout.slot_expert, e), [layout.group])
        if stats is not None:
            stats.add(key + "_amax", amax.numel() * amax.element_size())  # all-reduce payload
    first = layout.rank * e_l  # this rank's first global expert
    scale = _delayed_scales(row_q, states, amax[first:first + e_l] if amax is not None else None, layout,
                            advance, stats, key)
    return _wire.quantize_slots(quantizer, x, layout.slot_expert, layout.slot_offsets, amax, scale)


def quantized_exchange(x_perm, route: Route, quantizer, *, multiple: int, need_columnwise: bool,
                       stats, key: str, packed_multiple: int | None = None, values: bool = True,
                       states=None, advance: bool = True, payload=None):
    """Send the slots' rowwise direction in ``quantizer``'s format (``_wire``: one quantize
    pass over all slots) and build the experts' :class:`GroupedQuantized` (padded to
    ``multiple``) at the receiver; with ``packed_multiple`` (``grouped_quantized.
    exchange_packable``), their ``device_split.PackedSplit`` for the sync-free grouped GEMMs
    instead. Delayed scaling needs ``states``, this rank's local experts' states of the
    quantizer's role: advanced first (unless ``advance=False``: an activation recompute),
    then their scales quantize every sender's rows and the step's amax is recorded in them
    (``_wire`` module doc). ``payload``: ``quantize_payload``'s result for these slots, made
    earlier (else made here). Returns that and the received rows' values ``[R, K]`` in x's
    dtype (expert-major), or None without ``values``."""
    e_l = route.num_experts // route.world
    x = x_perm.detach()
    row_q = quantizer.direction_quantizer("rowwise")
    slots = payload if payload is not None else quantize_payload(x, route, quantizer, stats=stats, key=key,
                                                                 states=states, advance=advance)
    first = route.rank * e_l  # this rank's first global expert
    recv = all_to_all(_wire.pack(slots), route.send_splits, route.recv_splits, route, stats, key)  # source-major
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
    recv = to_expert_major(recv, route)
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


def _delayed_scales(row_q, states, local_amax, route: Route | RouteStart, advance: bool, stats, key: str):
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
