"""Quantized token payloads: rowwise storages packed into one byte row per token.

A rowwise direction whose blocks run along K only (block rows = 1: per-tensor FP8, MXFP8
1×32, FP8 1×128, NVFP4 1×16, identity) quantizes each token on its own, given the
per-tensor amax. So a source rank can quantize the rows it sends to expert e with the
amax of **all** of e's rows (one all-reduce MAX of an ``[E]`` vector) and the receiver
gets exactly the rows it would have made from the high-precision tokens.

The sender quantizes all its slots at once (``quantize_slots``): one storage whose
per-tensor fields are ``[E]`` vectors, each row quantized with its expert's entry, so per
expert the bytes are those of quantizing its rows alone. Delayed scaling's scale is not
computed from this step's amax but held by the expert's state on the expert's rank: the
exchange advances each rank's local states, gathers their scales into the ``[E]`` vector
every sender uses, and records the all-reduced amax into the local states, the order and
values of quantizing the received rows there.

Wire row of one token: the row-axis fields of the storage (``data``, block scales) viewed
as bytes and concatenated: ``[m, Σ bytes per row]`` uint8. Per-tensor fields are not sent:
every rank computes them from the same all-reduced amax (``expert_rows`` picks an
expert's entry).

The columnwise direction blocks along tokens that come from several ranks, so it is made
at the receiver from the received rows (``columnwise_of``), one of two ways:

* derived: the rowwise bits transposed (per-tensor FP8 with one quantizer for both
  directions; identity). Exact: bitwise the high-precision exchange.
* requantized: the columnwise quantization of the rows' dequantized values
  ``r = deq(Q_row(x))``, per expert, zero-padded as ``split_quantize`` pads, when both
  directions are power-of-two block formats (MXFP8; FP8 blocks with ``power_of_2_scales``;
  the rowwise may also be identity). ``r`` is exact in bf16/fp32 (a code times a power of
  two; below about 2**-126 bf16 may round) and lies within the rowwise quantization error
  of x, so each element differs from the high-precision path's ``Q_col(x)`` by at most

      |deq Q_col(r) − deq Q_col(x)| ≤ ½ (u_row + u_col(r) + u_col(x))

  with ``u`` the spacing of the element grid at the element's code times its block scale
  (RNE errs by at most half of it). With the same element dtype both ways it is mostly
  zero: with power-of-two scales a normal (non-subnormal) code rounds x to the dtype's
  significand width whatever the scale, and rounding twice to one width is rounding
  once, so an element whose row code and both column codes are normal equals the
  high-precision path's bitwise; the others (elements below 2**-6 (E4M3) of their block's
  scale) carry the error above. Measured on a GroupedLinear wgrad: ``tests_distributed/
  test_moe_ep_columnwise.py``.

* requantized NVFP4: an NVFP4 columnwise (1D blocks, Hadamard transform, no stochastic
  rounding) from a power-of-two block rowwise (``mxfp8_fwd_nvfp4_bwd``'s x), quantized per
  expert: its global scale comes from the expert's amax, and every row of the expert
  arrives at the expert's rank. The input is ``r``, not x: an FP4 code differs where the
  rowwise rounding moved a value across an FP4 rounding boundary, and the global scale
  follows amax(r). The wgrad operand then carries the rowwise error (MXFP8: about −31 dB
  of x) beside NVFP4's own (about −16 dB): dW's SQNR against the exact product drops by
  ~0.15 dB (``tests_distributed/test_moe_ep_columnwise.py``), for half the bytes of the
  high-precision exchange.

``unsupported_reason`` says when a quantizer can use none of these (the caller then
exchanges high precision and quantizes after): an NVFP4 rowwise (its values are not exact
inputs for a second quantization), and stochastic rounding in the sender's direction (the
draws belong to the expert's generator).
"""

from __future__ import annotations

import dataclasses

import torch

from hybrid_dist.formats.float8 import Float8Quantizer, Float8Storage
from hybrid_dist.formats.float8_block import Float8BlockQuantizer
from hybrid_dist.formats.identity import IdentityQuantizer
from hybrid_dist.formats.mxfp8 import MXFP8Quantizer
from hybrid_dist.formats.nvfp4 import NVFP4Quantizer, NVFP4Storage, nvfp4_global_scale, nvfp4_quantize_rows
from hybrid_dist.formats import DirectionStorage
from hybrid_dist.derived_columnwise import derivable_columnwise, derive_columnwise
from hybrid_dist.moe import device_split


def unsupported_reason(q, *, need_columnwise: bool) -> str | None:
    """None if ``q``'s rowwise can be quantized per source rank (and its columnwise derived
    at the receiver when needed); else why not."""
    row, col = q.direction_quantizer("rowwise"), q.direction_quantizer("columnwise")
    if row.block_shape("rowwise")[0] != 1:
        return f"{type(row).__name__} rowwise blocks span {row.block_shape('rowwise')[0]} tokens"
    if isinstance(row, NVFP4Quantizer) and row.stochastic_rounding:
        return "stochastic rounding draws from the expert's generator"
    if need_columnwise and isinstance(col, IdentityQuantizer) and not derivable_columnwise(q):
        return ("the columnwise (wgrad) direction is high precision: its rows are the payload, and "
                "sending them alone is cheaper than sending them beside quantized rows")
    if need_columnwise and not (derivable_columnwise(q) or requantized_columnwise(q)):
        return (f"the columnwise (wgrad) direction {type(col).__name__} blocks along tokens from "
                "several ranks; the receiver makes it only as the rowwise bits transposed (one "
                "per-tensor FP8 quantizer both ways) or by requantizing the received values when "
                "the rowwise is a power-of-two block format (MXFP8, FP8 blocks) and the columnwise "
                "one too or NVFP4 without stochastic rounding")
    return None


def _pow2_blocks(q) -> bool:
    """Per-block power-of-two scales, no per-tensor scale, no state (MXFP8; FP8 blocks with
    ``power_of_2_scales``): dequantized values are exact in bf16/fp32 (module doc)."""
    return isinstance(q, MXFP8Quantizer) or (isinstance(q, Float8BlockQuantizer) and q.power_of_2_scales)


def _receiver_nvfp4(q) -> bool:
    """An NVFP4 direction the receiver can quantize from values alone: 1D blocks, no
    stochastic rounding (its per-expert global scale, and the Hadamard transform, come from
    the expert's rows, which all arrive at the expert's rank)."""
    return isinstance(q, NVFP4Quantizer) and not q.block_2d and not q.stochastic_rounding


def requantized_columnwise(q) -> bool:
    """The receiver makes the columnwise direction by quantizing the received rows'
    dequantized values (module doc): the rowwise a power-of-two block format (or identity),
    so those values are exact, and the columnwise a power-of-two block format or a
    receiver-side NVFP4 (``_receiver_nvfp4``), so the result depends on them alone."""
    row, col = q.direction_quantizer("rowwise"), q.direction_quantizer("columnwise")
    return (not derivable_columnwise(q) and (_pow2_blocks(col) or _receiver_nvfp4(col))
            and (_pow2_blocks(row) or isinstance(row, IdentityQuantizer)))


def columnwise_of(q, row: DirectionStorage, values: torch.Tensor) -> DirectionStorage:
    """The receiver's columnwise storage ``[K, p]`` of one expert's padded rows: ``row``
    transposed where derivable, else ``q``'s columnwise quantization of ``values [p, K]``
    (the rows dequantized: zeros in the padding, as the high-precision path pads)."""
    if derivable_columnwise(q):
        return derive_columnwise(row)
    if requantized_columnwise(q):
        return q.direction_quantizer("columnwise").quantize_storages(values, rowwise=False, columnwise=True)[1]
    raise AssertionError(f"no receiver columnwise for {q}")


def _row_fields(st: DirectionStorage) -> list[str]:
    return [f for f in st.TENSOR_FIELDS if "R" in st.field_axes()[f]]


def _tensor_fields(st: DirectionStorage) -> list[str]:
    return [f for f in st.TENSOR_FIELDS if not st.field_axes()[f]]


def quantize_slots(q, x: torch.Tensor, slot_expert: torch.Tensor, slot_offsets: torch.Tensor,
                   amax: torch.Tensor | None, scale: torch.Tensor | None = None) -> DirectionStorage:
    """The rowwise storage of every slot ``x [S, K]`` (rows sorted by expert) in one pass;
    its per-tensor fields are ``[E]`` vectors, entry e for expert e's rows. Per slot the
    bytes are those of quantizing expert e's rows alone with ``amax[e]`` (module doc):

    * no per-tensor scale (MXFP8, FP8 1×128, identity): the blocks are per token, so one
      quantize of all rows;
    * per-tensor FP8: each row times its expert's scale, one cast (``device_split.
      fp8_rows_by_expert``: the Triton row-cast kernel on CUDA bf16);
    * NVFP4 (1D, no SR): each row's block scales against its expert's global scale.

    ``slot_expert [S]``: each row's expert; ``slot_offsets [E+1]``: each expert's first row;
    ``amax [E]``: the all-reduced amaxes (None for formats without a per-tensor scale);
    ``scale [E]``: delayed scaling's per-expert scales (the experts' states', gathered)."""
    row = q.direction_quantizer("rowwise")
    if isinstance(row, Float8Quantizer):
        scale, scale_inv = (device_split.expert_scales(row, x, amax, None) if scale is None
                            else (scale, torch.reciprocal(scale)))
        data = device_split.fp8_rows_by_expert(x, scale, slot_expert, slot_offsets, row.dtype)
        return Float8Storage(data=data, scale_inv=scale_inv, transposed=False)
    if isinstance(row, NVFP4Quantizer):
        gs = nvfp4_global_scale(amax.float().to(x.device))
        data, bs = nvfp4_quantize_rows(x.float(), gs[slot_expert][:, None], block_rows=1, rand=None)
        return NVFP4Storage(data=data, block_scale=bs, global_scale=gs, block_rows=1, rht_seed=None, transposed=False)
    if row.is_per_tensor:
        raise AssertionError(f"no one-pass slot quantization for the per-tensor {type(row).__name__}")
    st, _ = row.quantize_storages(x, rowwise=True, columnwise=False)
    return st


def pack(st: DirectionStorage) -> torch.Tensor:
    """``[m, bytes]`` uint8: the row fields of a rowwise storage side by side (one field,
    per-tensor FP8's codes: a view of it, no copy)."""
    parts = [getattr(st, f).contiguous() for f in _row_fields(st)]
    rows = [p.reshape(p.shape[0], torch.Size(p.shape[1:]).numel()).view(torch.uint8) for p in parts]
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=1)


def row_bytes(st: DirectionStorage) -> int:
    """Bytes one token takes on the wire in ``st``'s format."""
    return sum(getattr(st, f).element_size() * torch.Size(getattr(st, f).shape[1:]).numel()
               for f in _row_fields(st))


def unpack(buf: torch.Tensor, like: DirectionStorage, dest: torch.Tensor, rows: int) -> DirectionStorage:
    """Inverse of ``pack``: wire row i lands on row ``dest[i]`` of a zero-filled storage of
    ``rows`` rows in ``like``'s format (its per-tensor fields kept as they are)."""
    return split_fields(buf.new_zeros(rows, buf.shape[1]).index_copy_(0, dest, buf), like)


def split_fields(placed: torch.Tensor, like: DirectionStorage) -> DirectionStorage:
    """The storage in ``like``'s format whose row fields are the byte rows ``placed [C,
    bytes]`` (``pack``'s layout; its per-tensor fields kept as they are)."""
    rows, out, col = placed.shape[0], {}, 0
    for f in _row_fields(like):
        t = getattr(like, f)
        width = t.element_size() * torch.Size(t.shape[1:]).numel()
        out[f] = placed[:, col:col + width].contiguous().view(t.dtype).reshape(rows, *t.shape[1:])
        col += width
    return dataclasses.replace(like, **out)


def expert_rows(st: DirectionStorage, expert: int, start: int, length: int) -> DirectionStorage:
    """Rows ``[start, start + length)`` of a slot storage with ``expert``'s entry of each
    ``[E]`` per-tensor field (``quantize_slots``)."""
    part = st.narrow_dim0(start, length)
    return part.with_tensors({f: getattr(st, f)[expert] for f in _tensor_fields(st)})
