"""Opaque per-expert ops over the packed token layout, for the CPU reference.

Legend: E experts, C the packed capacity (``device_split``), ``poff [E+1]`` int64 the
padded offsets (expert e owns packed rows ``[poff_e, poff_{e+1})``, ``p_e`` of them).

Each op loops over the experts on the host, reading ``poff`` inside the op, and runs on
each expert's segment exactly the op the per-expert reference runs on its padded slice
(same shapes, same strides, same generator), so the results are bitwise the reference's.
To ``torch.compile`` each is one ``torch.library`` op with a fixed output shape (its fake
implementation), so tracing needs neither a graph break nor a shape that depends on the
routing, and one graph serves every split of the tokens. On CPU reading ``poff`` is a
plain memory read; on CUDA it would be a device-to-host sync (the CUDA paths use
``torch._grouped_mm`` / ``torch._scaled_grouped_mm`` instead, ``grouped_quantized``).

    segment_mm_rows    out [C, R]    : out[seg e] = a[seg e] [p_e, K] · b[e] [R, K]ᵀ    (fprop, dgrad)
    segment_mm_tokens  out [E, Ra, Rb]: out[e] = a[:, seg e] [Ra, p_e] · b[:, seg e]ᵀ    (wgrad)
    segment_state_rand out [C, W] or [W, C]: segment e = ``torch.rand([p_e, W])`` (or
                       ``[W, p_e]``) from expert e's stochastic-rounding generator

Rows (columns) past ``poff[E]`` are zero.
"""

from __future__ import annotations

import torch

from hybrid_dist.formats import traced_rng
from hybrid_dist.library_op import library_op

__all__ = ["segment_mm_rows", "segment_mm_tokens", "segment_state_rand"]


def _bounds(poff: torch.Tensor) -> list[tuple[int, int]]:
    ends = [int(v) for v in poff.tolist()]
    return list(zip(ends[:-1], ends[1:]))


@library_op("hybrid_dist::segment_mm_rows")
def segment_mm_rows(a: torch.Tensor, b: torch.Tensor, poff: torch.Tensor) -> torch.Tensor:
    """``a [C, K]`` fp32, ``b [E, R, K]`` fp32 → fp32 ``[C, R]`` (module doc)."""
    out = a.new_zeros(a.shape[0], b.shape[1])
    for e, (s, t) in enumerate(_bounds(poff)):
        if t > s:
            out[s:t] = a[s:t] @ b[e].t()
    return out


@segment_mm_rows.register_fake
def _(a, b, poff):
    return a.new_empty(a.shape[0], b.shape[1])


@library_op("hybrid_dist::segment_mm_tokens")
def segment_mm_tokens(a: torch.Tensor, b: torch.Tensor, poff: torch.Tensor) -> torch.Tensor:
    """``a [Ra, C]``, ``b [Rb, C]`` fp32 → fp32 ``[E, Ra, Rb]``; each segment made contiguous
    first, as the reference's per-expert operands are (module doc)."""
    bounds = _bounds(poff)
    out = a.new_zeros(len(bounds), a.shape[0], b.shape[0])
    for e, (s, t) in enumerate(bounds):
        out[e] = a[:, s:t].contiguous() @ b[:, s:t].contiguous().t()
    return out


@segment_mm_tokens.register_fake
def _(a, b, poff):
    return a.new_empty(poff.shape[0] - 1, a.shape[0], b.shape[0])


@library_op("hybrid_dist::segment_state_rand")
def _segment_state_rand(like: torch.Tensor, uids: list[torch.Tensor], poff: torch.Tensor, width: int,
                        capacity: int, transposed: bool, draw: int) -> torch.Tensor:
    out = torch.zeros((width, capacity) if transposed else (capacity, width), device=like.device)
    for uid, (s, t) in zip(uids, _bounds(poff)):
        gen = traced_rng.registered_state(uid).generator(like.device)
        shape = (width, t - s) if transposed else (t - s, width)
        r = torch.rand(shape, device=like.device, generator=gen)
        if transposed:
            out[:, s:t] = r
        else:
            out[s:t] = r
    return out


@_segment_state_rand.register_fake
def _(like, uids, poff, width, capacity, transposed, draw):
    return like.new_empty((width, capacity) if transposed else (capacity, width), dtype=torch.float32)


def segment_state_rand(states, like: torch.Tensor, poff: torch.Tensor, *, width: int, capacity: int,
                       transposed: bool, draw: int) -> torch.Tensor:
    """fp32 uniform draws of the packed buffer (module doc); ``states[e]`` expert e's
    ``NVFP4State``; ``draw`` tells apart two draws of one shape (``traced_rng``)."""
    if any(s.uid is None for s in states):
        raise RuntimeError(
            "a stochastic-rounding quantizer state was created inside torch.compile; create it "
            "before compiling (give GroupedLinear its recipe= at construction and call plan_for, "
            "or run one eager forward first)")
    return _segment_state_rand(like, [s.uid for s in states], poff, width, capacity, transposed, draw)
