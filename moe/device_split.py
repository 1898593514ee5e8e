"""``split_quantize_packed``: the sync-free form of ``split_quantize`` (packed layout).

Everything is sized from shapes known on the host — ``T``, ``E`` and the padding multiple
``b`` — never from ``tokens_per_expert``'s values, so no device-to-host sync (one exception:
NVFP4 in eager steps on CUDA, below):

    capacity C, eid [T], dest [T], row_expert [C]: ``packed_index`` (one launch on CUDA)
    x_pad [C, K]: x scattered to ``dest``; rows ≥ poff[-1] and padding rows are zero

Every expert's segment starts at a multiple of b, so quantizing ``x_pad`` as one tensor
gives, per expert, exactly the blocks of quantizing its padded slice alone (the packed
form of ``split_quantize``, which the tests check bitwise). Per-tensor formats (FP8)
need a scale per expert: amax per expert by ``scatter_reduce`` (amax), the quantizer's
own ``compute_scale`` on the ``[E]`` vector, applied per row through ``eid``.

NVFP4 likewise: a global scale per expert (from the per-expert amax, of the Hadamard-
transformed columnwise values when ``rht``), broadcast per row (rowwise) or per 16-token
block (columnwise) into the block-scale encoding. Eager on CUDA, each expert's padded
segment instead goes through the dense NVFP4 kernels (``_per_expert_nvfp4_slices``: the
quantizer's own amax and quantize passes, written into the packed buffers), which reads the
padded offsets on the host once per split; both directions of one NVFP4 quantizer come from
one call per expert, the call ``split_quantize`` makes, so the result is bitwise
``split_quantize``'s (stochastic rounding too: each segment draws from its expert's state).
Compiled graphs and the CPU keep the torch form.

Supported: identity, MXFP8, FP8 block (1x128, 128x128), per-tensor FP8 (current or
delayed) and NVFP4 with 1D blocks, alone or paired in a ``HybridQuantizer``. NVFP4 2D
blocks (weights) raise ``NotImplementedError``: use ``split_quantize``.

NVFP4 stochastic rounding draws ONE uniform tensor over the packed buffer (per direction,
from expert 0's state generator; ``split_quantize`` draws per expert for its padded
shape, which needs the sizes on the host). Same rounding law, other random numbers: SR
results are statistically, not bitwise, those of ``split_quantize``; without SR the two
are bitwise equal. ``per_expert_draws=True`` draws as ``split_quantize`` does instead
(``_segment_ops.segment_state_rand``: an opaque op that reads the offsets on the host,
for the CPU reference), bitwise equal with SR too. The encode builds no tensor on the
host (``numerics.e2m1_encode``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from hybrid_dist.kernels import TRITON_INSTALLED, kernels_serve
from hybrid_dist.moe._checks import check_token_counts
from hybrid_dist.formats.numerics import FP8_MAX, cast_to_fp8
from hybrid_dist.formats.float8 import DelayedScalingState, Float8Quantizer, stacked_delayed_states, transposed_fp8
from hybrid_dist.formats.float8_block import Float8BlockQuantizer
from hybrid_dist.formats.identity import IdentityQuantizer
from hybrid_dist.formats.mxfp8 import MXFP8Quantizer
from hybrid_dist.formats import traced_rng
from hybrid_dist.formats.nvfp4 import NV_BLOCK, NVFP4Quantizer, NVFP4State, nvfp4_global_scale, nvfp4_quantize_rows
from hybrid_dist.formats.numerics import apply_hadamard16, hadamard16
from hybrid_dist.moe._segment_ops import segment_state_rand
from hybrid_dist.moe.packed_index import IndexCache, packed_index
from hybrid_dist.moe.split_quantize import token_multiple

__all__ = ["PackedSplit", "expert_amaxes", "expert_scales", "fp8_rows_by_expert", "packed_fp8_rows", "place_rows",
           "split_quantize_packed", "unsupported_reason"]

_BLOCK_ONLY = (IdentityQuantizer, MXFP8Quantizer, Float8BlockQuantizer)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackedSplit:
    """Packed per-expert quantization (see module doc); all tensors on x's device.

    ``rowwise`` / ``columnwise``: field name → tensor, laid out as the stored forms of the
    ``[C, K]`` padded buffer (rowwise ``[C, ...]``, columnwise ``[K, C/...]``), with
    per-tensor fields (FP8 ``scale_inv``) as ``[E]``. ``dest [T]`` maps each input row to
    its padded row (gather GEMM outputs with it); ``row_expert [C]`` is each padded row's
    expert (E for rows past the last expert).
    """

    rowwise: dict[str, torch.Tensor] | None
    columnwise: dict[str, torch.Tensor] | None
    offsets: torch.Tensor
    padded_offsets: torch.Tensor
    dest: torch.Tensor
    row_expert: torch.Tensor
    capacity: int
    multiple: int


class _Layout:
    """The packed index space of one call (module doc); ``x_pad`` is built on first use
    (per-tensor FP8 on CUDA writes its codes from ``x`` directly and never needs it)."""

    def __init__(self, x, tokens_per_expert, multiple, cache: IndexCache | None = None):
        rows = x.shape[0]
        cache = IndexCache.serving(cache, tokens_per_expert, rows)
        index = cache.get(multiple) if cache is not None else packed_index(tokens_per_expert, rows, multiple)
        self.x, self.num_experts, self.cap = x, tokens_per_expert.numel(), index.capacity
        self.off, self.poff, self.eid, self.dest, self.row_expert = (index.offsets, index.padded_offsets, index.eid,
                                                                     index.dest, index.row_expert)
        self._x_pad = None

    @classmethod
    def placed(cls, x_pad: torch.Tensor, split: "PackedSplit") -> "_Layout":
        """``split``'s layout over rows already placed in it (for the quantizers of ``x_pad``)."""
        lay = cls.__new__(cls)
        lay.x, lay._x_pad, lay.eid, lay.num_experts = x_pad, x_pad, None, len(split.offsets) - 1
        lay.off, lay.poff, lay.dest, lay.row_expert, lay.cap = (split.offsets, split.padded_offsets, split.dest,
                                                                split.row_expert, split.capacity)
        return lay

    @property
    def x_pad(self) -> torch.Tensor:
        if self._x_pad is None:
            self._x_pad = self.x.new_zeros(self.cap, self.x.shape[1]).index_copy_(0, self.dest, self.x)
        return self._x_pad


def _fp8_kernel_fits(x) -> bool:
    """Per-tensor FP8 through the Triton ``kernels.fp8.rows`` kernels (eager, or as operators in
    compiled graphs), else the torch form."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and x.stride(-1) == 1):
        return False
    return TRITON_INSTALLED


def expert_amaxes(x: torch.Tensor, row_expert: torch.Tensor, num_experts: int) -> torch.Tensor:
    """fp32 ``[E]``: ``max |x[t]|`` over the rows of each expert (0 for none); ``x [T, K]``
    rows sorted by expert, ``row_expert [T]`` each row's expert. Exact (a max), so bitwise
    ``tensor_amax`` of each expert's rows: one Triton pass on CUDA bf16, else max per row
    then per expert."""
    if _fp8_kernel_fits(x):
        from hybrid_dist.kernels.fp8.rows import expert_amax

        return expert_amax(x, row_expert, num_experts)
    row_amax = torch.linalg.vector_norm(x, float("inf"), dim=1).float() if x.shape[0] \
        else x.new_zeros(0, dtype=torch.float32)
    return torch.zeros(num_experts, dtype=torch.float32, device=x.device).scatter_reduce(
        0, row_expert, row_amax, reduce="amax", include_self=True)


def fp8_rows_by_expert(x: torch.Tensor, scale: torch.Tensor, row_expert: torch.Tensor, offsets: torch.Tensor,
                       dtype: torch.dtype) -> torch.Tensor:
    """fp8 ``[T, K]``: ``cast_fp8(x[t] · scale[row_expert[t]])`` for ``x [T, K]`` sorted by
    expert (no padding), ``scale [E]`` fp32, ``offsets [E+1]`` each expert's first row: the
    Triton ``fp8_rows`` kernel where it serves ``x``, else the torch form (the same bytes:
    one fp32 product, a saturating round-to-nearest-even cast)."""
    if _fp8_kernel_fits(x):
        from hybrid_dist.kernels.fp8.rows import fp8_rows

        return fp8_rows(x, scale, row_expert, offsets, offsets, dtype, rowwise=True, columnwise=False)[0]
    return cast_to_fp8(x * scale.float()[row_expert][:, None], dtype)  # fp32 product (type promotion)


def expert_scales(q: Float8Quantizer, x, amax, states):
    """fp32 ``(scale [E], scale_inv [E])`` of each expert (current scaling: from ``amax``;
    delayed: the states', recording ``amax``). On CUDA current scaling's divisions run in
    one launch (eager) or operator (compiled) with torch's rounding (``kernels.fp8.scales``)."""
    compiling = torch.compiler.is_compiling()
    use_kernel = x.is_cuda and TRITON_INSTALLED and (compiling or q.scaling == "current")
    scale = None
    if q.scaling == "delayed" and not compiling and all(isinstance(s, DelayedScalingState) for s in states):
        hist, scale = stacked_delayed_states(states, x.device)  # every expert's state at once
        torch.maximum(hist[:, 0], amax, out=hist[:, 0])  # = state.record(amax[i]) for each i
        scale = scale.clone()
    elif q.scaling == "delayed":  # traced (stacking rebinds the states' tensors) or wrong states (raises)
        scale = torch.stack([q.compute_scale(x, states[i], amax[i]) for i in range(amax.numel())])
    elif not use_kernel:
        scale = q.compute_scale(x, None, amax)
    if not use_kernel:
        return scale, torch.reciprocal(scale)
    from hybrid_dist.kernels.fp8.scales import fp8_expert_scales

    amax32 = amax.float().contiguous()
    return fp8_expert_scales(amax32, amax32 if scale is None else scale.float().contiguous(), FP8_MAX[q.dtype],
                             float(q.amax_epsilon), q.power_of_2_scales, scale is None)


def _per_expert_fp8(q: Float8Quantizer, lay: _Layout, states, *, rowwise: bool, columnwise: bool):
    """FP8 with one scale per expert: ``(rowwise fields or None, columnwise fields or None)``
    (one cast for both; the columnwise codes are the rowwise ones transposed)."""
    x = lay.x
    scale, scale_inv = expert_scales(q, x, expert_amaxes(x, lay.eid, lay.num_experts), states)
    if _fp8_kernel_fits(x):
        from hybrid_dist.kernels.fp8.rows import fp8_rows

        row, col = fp8_rows(x, scale, lay.row_expert, lay.off, lay.poff, q.dtype, rowwise=rowwise,
                            columnwise=columnwise)
    else:
        scale_rows = torch.cat([scale, scale.new_ones(1)])[lay.row_expert]  # rows past the experts: zeros anyway
        row = cast_to_fp8(lay.x_pad * scale_rows[:, None], q.dtype)  # fp32 product (type promotion)
        col = transposed_fp8(row) if columnwise else None  # not fused with the cast while compiling
    return ({"data": row, "scale_inv": scale_inv} if rowwise else None,
            {"data": col, "scale_inv": scale_inv} if columnwise else None)


def _nvfp4_slices_fit(x: torch.Tensor, per_expert_draws: bool) -> bool:
    """Eager on CUDA with the Triton kernels: NVFP4 through the dense quantize kernel per
    expert segment (``_per_expert_nvfp4_slices``)."""
    return kernels_serve(x) and not per_expert_draws


def _per_expert_nvfp4_slices(q: NVFP4Quantizer, lay: _Layout, states, *, rowwise: bool, columnwise: bool):
    """``(rowwise fields or None, columnwise fields or None)`` of ``_per_expert_nvfp4``, as one
    quantize call per non-empty expert on its padded segment of ``x_pad`` for every requested
    direction at once (the dense NVFP4 kernels on CUDA: an amax pass and one quantize pass,
    instead of ~20 torch passes over fp32 ``[C, K]`` per direction), written into the packed
    buffers. Reads the padded offsets on the host once. Each segment is the call
    ``split_quantize`` makes for that expert (stochastic rounding from its own state). Rows
    past the last expert stay zero, as the torch form quantizes them (zero codes, zero block
    scales)."""
    x_pad, e = lay.x_pad, lay.num_experts
    c, k = x_pad.shape
    shapes = {"rowwise": ((c, k // 2), (c, k // NV_BLOCK)), "columnwise": ((k, c // 2), (k, c // NV_BLOCK))}
    dirs = [d for d, want in (("rowwise", rowwise), ("columnwise", columnwise)) if want]
    out = {d: {"data": x_pad.new_zeros(shapes[d][0], dtype=torch.uint8),
               "block_scale": x_pad.new_zeros(shapes[d][1], dtype=torch.float8_e4m3fn), "global_scale": []}
           for d in dirs}
    ones = torch.ones((), dtype=torch.float32, device=x_pad.device)  # an empty expert: amax 0, scale 1
    ends = [int(v) for v in lay.poff.tolist()]  # the one host read
    for i in range(e):
        lo, hi = ends[i], ends[i + 1]
        if hi == lo:
            for d in dirs:
                out[d]["global_scale"].append(ones)
            continue
        row, col = q.quantize_storages(x_pad[lo:hi], rowwise=rowwise, columnwise=columnwise, state=states[i])
        for d, st in (("rowwise", row), ("columnwise", col)):
            if st is None:
                continue
            rows = slice(lo, hi) if d == "rowwise" else slice(None)
            out[d]["data"][rows, slice(None) if d == "rowwise" else slice(lo // 2, hi // 2)] = st.data
            out[d]["block_scale"][rows, slice(None) if d == "rowwise" else slice(lo // NV_BLOCK, hi // NV_BLOCK)] \
                = st.block_scale
            out[d]["global_scale"].append(st.global_scale.reshape(()).float())
    for d in dirs:
        gs = out[d]["global_scale"]
        out[d]["global_scale"] = torch.stack(gs) if gs else ones.new_zeros(0)
    return out.get("rowwise"), out.get("columnwise")


def _per_expert_nvfp4(q: NVFP4Quantizer, lay: _Layout, states, *, direction, per_expert_draws: bool):
    """NVFP4 (1D blocks) with one global scale per expert; RHT on the columnwise direction
    as the quantizer does (16-blocks along tokens never straddle experts). Stochastic
    rounding: one draw over the packed buffer from expert 0's state, or each expert's
    segment from its own state (module doc). Eager on CUDA: ``_per_expert_nvfp4_slices``."""
    if _nvfp4_slices_fit(lay.x, per_expert_draws):
        row, col = _per_expert_nvfp4_slices(q, lay, states, rowwise=direction == "rowwise",
                                            columnwise=direction == "columnwise")
        return row or col
    x_pad, row_expert, e = lay.x_pad, lay.row_expert, lay.num_experts
    v = x_pad.float() if direction == "rowwise" else x_pad.t().float()
    if direction == "columnwise" and q.rht:
        v = apply_hadamard16(v, hadamard16(q.rht_seed, v.device))
    tok_amax = v.abs().amax(dim=1 if direction == "rowwise" else 0) if v.numel() else v.new_zeros(v.shape[0])
    amax = torch.zeros(e + 1, dtype=torch.float32, device=v.device).scatter_reduce(
        0, row_expert, tok_amax, reduce="amax", include_self=True)[:e]
    gs = nvfp4_global_scale(amax)
    gs_tok = torch.cat([gs, gs.new_ones(1)])[row_expert]
    gs_b = gs_tok[:, None] if direction == "rowwise" else gs_tok[::NV_BLOCK][None, :]
    rand, draw = None, int(direction == "columnwise")
    if q.stochastic_rounding and per_expert_draws and all(isinstance(s, NVFP4State) for s in states):
        rand = segment_state_rand(states, v, lay.poff, width=x_pad.shape[1], capacity=lay.cap,
                                  transposed=direction == "columnwise", draw=draw)
    elif q.stochastic_rounding:
        rand = traced_rng.state_rand(states[0], v, v.shape, draw=draw) \
            if isinstance(states[0], NVFP4State) else torch.rand(v.shape, device=v.device)
    data, bs = nvfp4_quantize_rows(v, gs_b, block_rows=1, rand=rand)
    return {"data": data, "block_scale": bs, "global_scale": gs}


def _fp8_shared(q) -> bool:
    """Both directions the same per-tensor FP8 quantizer (and state): the columnwise
    codes are the rowwise codes transposed."""
    row = q.direction_quantizer("rowwise")
    return isinstance(row, Float8Quantizer) and row == q.direction_quantizer("columnwise")


def unsupported_reason(q) -> str | None:
    """None when ``split_quantize_packed`` quantizes both directions of ``q``; else why not."""
    for d in ("rowwise", "columnwise"):
        dq = q.direction_quantizer(d)
        if isinstance(dq, NVFP4Quantizer) and dq.block_2d:
            return f"NVFP4 {d} with 2D blocks"
        if not isinstance(dq, (Float8Quantizer, NVFP4Quantizer) + _BLOCK_ONLY):
            return f"{type(dq).__name__} ({d})"
    return None


def _direction_fields(q, lay: _Layout, states, direction, per_expert_draws: bool):
    dq = q.direction_quantizer(direction)
    if isinstance(dq, NVFP4Quantizer) and not dq.block_2d:
        st = [q.direction_state(s, direction) for s in states]
        return _per_expert_nvfp4(dq, lay, st, direction=direction, per_expert_draws=per_expert_draws)
    if isinstance(dq, Float8Quantizer):
        st = [q.direction_state(s, direction) for s in states]
        row, col = _per_expert_fp8(dq, lay, st, rowwise=direction == "rowwise", columnwise=direction == "columnwise")
        return row or col
    if isinstance(dq, _BLOCK_ONLY):
        row, col = dq.quantize_storages(lay.x_pad, rowwise=direction == "rowwise",
                                        columnwise=direction == "columnwise")
        return (row or col).tensors()
    raise NotImplementedError(
        f"split_quantize_packed does not support {type(dq).__name__} ({direction}): its scale encoding "
        "is per expert inside the format. Use hybrid_dist.moe.split_quantize (reference, reads the "
        "split sizes on the host)."
    )


def split_quantize_packed(
    x: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    quantizer,
    *,
    rowwise: bool = True,
    columnwise: bool = True,
    states: Sequence[Any] | None = None,
    multiple: int | None = None,
    per_expert_draws: bool = False,
    index: IndexCache | None = None,
) -> PackedSplit:
    """Quantize expert e's rows of ``x [T, K]`` (one quantizer for all experts, one state
    per expert) into the packed padded layout, with no device-to-host sync.
    ``per_expert_draws``: NVFP4 stochastic rounding draws each expert's padded segment
    from its own state, as ``split_quantize`` does (bitwise its draws; an opaque op that
    reads the offsets on the host: the CPU reference, ``grouped_reference``). ``index``: the
    layout's index when it serves these counts and rows (``packed_index.IndexCache``; its
    owner made the counts, so they are not checked again), else one is built."""
    if x.dim() != 2 or tokens_per_expert.dim() != 1 or tokens_per_expert.device != x.device:
        raise ValueError(
            f"split_quantize_packed expects x [T, K] and tokens_per_expert [E] on x's device; got "
            f"{tuple(x.shape)} and {tuple(tokens_per_expert.shape)} on {tokens_per_expert.device}"
        )
    if not x.is_floating_point():
        raise ValueError(f"split_quantize_packed expects a floating-point x, got {x.dtype}")
    if IndexCache.serving(index, tokens_per_expert, x.shape[0]) is None:
        check_token_counts(tokens_per_expert, x.shape[0], "split_quantize_packed")
    e = tokens_per_expert.numel()
    states = list(states) if states is not None else [None] * e
    mult = multiple or token_multiple(quantizer)
    x = x.detach()
    lay = _Layout(x, tokens_per_expert, mult, index)
    if _fp8_shared(quantizer) and (rowwise or columnwise):  # one cast for both directions
        st = [quantizer.direction_state(s, "rowwise") for s in states]
        row, col = _per_expert_fp8(quantizer.direction_quantizer("rowwise"), lay, st, rowwise=rowwise,
                                   columnwise=columnwise)
    elif (rowwise and columnwise and isinstance(quantizer, NVFP4Quantizer) and not quantizer.block_2d
          and _nvfp4_slices_fit(x, per_expert_draws)):  # both directions from one read per expert
        row, col = _per_expert_nvfp4_slices(quantizer, lay, states, rowwise=True, columnwise=True)
    else:
        row = _direction_fields(quantizer, lay, states, "rowwise", per_expert_draws) if rowwise else None
        col = _direction_fields(quantizer, lay, states, "columnwise", per_expert_draws) if columnwise else None
    return PackedSplit(rowwise=row, columnwise=col, offsets=lay.off, padded_offsets=lay.poff, dest=lay.dest,
                       row_expert=lay.row_expert, capacity=lay.cap, multiple=mult)


def placed_columnwise(x_pad: torch.Tensor, split: PackedSplit, quantizer) -> dict[str, torch.Tensor]:
    """``split_quantize_packed``'s columnwise fields (block formats, NVFP4 1D; not per-tensor
    FP8; no state) of rows placed in ``split``'s layout (``x_pad [C, K]``): the expert-
    parallel receiver's."""
    return _direction_fields(quantizer, _Layout.placed(x_pad, split), [None] * (len(split.offsets) - 1),
                             "columnwise", False)


def place_rows(rows: torch.Tensor, tokens_per_expert: torch.Tensor, multiple: int, *,
               columnwise: bool = False, src: torch.Tensor | None = None, index: IndexCache | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None, PackedSplit]:
    """1-byte ``rows [T, W]`` in the packed layout, token t (expert order) from row ``src[t]``
    (None: row t): ``[C, W]`` with zero padding rows, its transpose ``[W, C]`` if
    ``columnwise`` (else None), and the layout's split without fields: one read of the rows
    (``kernels.fp8.rows.place_codes``) on CUDA, else a gather, ``index_copy`` and a
    transpose. The expert-parallel receiver's placement, ``src`` its regroup, ``index`` its
    route's (``split_quantize_packed``)."""
    if kernels_serve(rows) and rows.stride(-1) == 1:
        from hybrid_dist.kernels.fp8.rows import place_codes

        lay = _Layout(rows, tokens_per_expert, multiple, index)
        placed, placed_t = place_codes(rows, lay.row_expert, lay.off, lay.poff, columnwise=columnwise, src=src)
    else:
        lay = _Layout(rows if src is None else rows[src], tokens_per_expert, multiple, index)
        placed = lay.x_pad
        placed_t = placed.t().contiguous() if columnwise else None
    return placed, placed_t, PackedSplit(rowwise=None, columnwise=None, offsets=lay.off, padded_offsets=lay.poff,
                                         dest=lay.dest, row_expert=lay.row_expert, capacity=lay.cap,
                                         multiple=multiple)


def packed_fp8_rows(data: torch.Tensor, scale_inv: torch.Tensor, tokens_per_expert: torch.Tensor, multiple: int, *,
                    columnwise: bool, src: torch.Tensor | None = None, index: IndexCache | None = None
                    ) -> PackedSplit:
    """The packed split of rows already quantized per expert: per-tensor FP8 ``data [T, K]``
    (sorted by expert, or token t at row ``src[t]``: ``place_rows``), ``scale_inv [E]``
    fp32. Equal to ``split_quantize_packed`` of the high-precision rows with the same
    per-expert scales (the codes are placed, not recomputed; columnwise = rowwise
    transposed, as for every per-tensor FP8 quantizer). The expert-parallel receiver uses
    it (``quantized_exchange``)."""
    row, col, g = place_rows(data.view(torch.uint8), tokens_per_expert, multiple, columnwise=columnwise, src=src,
                             index=index)
    return dataclasses.replace(
        g, rowwise={"data": row.view(data.dtype), "scale_inv": scale_inv},
        columnwise={"data": col.view(data.dtype), "scale_inv": scale_inv} if columnwise else None)
