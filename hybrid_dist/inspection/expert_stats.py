"""Statistics of a grouped (MoE experts) GEMM operand: one row for all experts together.

A ``GroupedLinear`` operand is E experts' storages: per-expert ones (a list: the weight,
the per-expert loop's tokens) or one packed storage over the padded token rows whose
per-tensor fields (FP8 ``scale_inv``, NVFP4 ``global_scale``) are ``[E]`` (the CPU
reference's tokens). Expert e's rows of the high-precision ``x [T, K]`` are
``[offsets[e], offsets[e+1])``, zero-padded to ``p_e = poff[e+1] - poff[e]`` rows: the
padded slice its storage was quantized from (``split_quantize`` note), so ``numel``
counts the padding rows (zeros: they change no norm, amax, nonzero, underflow or
saturated count; their blocks are in the histogram, as in the GEMM). Each expert's
``quant_stats`` is computed against its slice and the E vectors are combined
(``combine_stats``). Offsets live on the device; the operators read them on the host
inside their implementation (``stats_op``: one opaque call per row, so a compiled graph
has no shape that depends on the routing and no graph break).
"""

from __future__ import annotations

import torch

from hybrid_dist.inspection.candidates import CANDIDATES, fits
from hybrid_dist.inspection.stats import WIDTH, combine_stats, quant_stats
from hybrid_dist.inspection.stats_op import storage_spec, storages_from_spec
from hybrid_dist.library_op import library_op


def _segments(x: torch.Tensor | None, offsets, poff, num_experts: int, rows: int):
    """``[(expert, padded hp slice or None, padded start, padded length)]`` of the experts
    with rows; ``offsets`` / ``poff`` None: ``num_experts`` equal segments of ``rows``."""
    if offsets is None:
        n = rows // num_experts
        bounds = [(e * n, n) for e in range(num_experts)]
        pbounds = bounds
    else:
        off, po = offsets.tolist(), poff.tolist()
        bounds = [(off[e], off[e + 1] - off[e]) for e in range(num_experts)]
        pbounds = [(po[e], po[e + 1] - po[e]) for e in range(num_experts)]
    out = []
    for e, ((s, m), (ps, p)) in enumerate(zip(bounds, pbounds)):
        if p == 0:
            continue
        out.append((e, None if x is None else _zero_pad_rows(x[s:s + m], p), ps, p))
    return out


def _zero_pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` with zero rows appended up to ``rows`` rows (``x`` has at most that many)."""
    extra = rows - x.shape[0]
    return torch.cat([x, x.new_zeros(extra, x.shape[1])]) if extra else x


def _expert_storage(storages: list, e: int, start: int, length: int):
    """Expert ``e``'s storage: ``storages[e]``, or the packed ``storages[0]`` narrowed to its
    padded rows with its per-tensor fields taken at ``e``."""
    if len(storages) > 1:
        return storages[e]
    st = storages[0].narrow_dim0(start, length)
    axes = st.field_axes()
    return st.with_tensors({f: t.reshape(-1)[e] for f, t in st.tensors().items() if not axes[f]})


@library_op("hybrid_dist::expert_storage_stats")
def expert_storage_stats_op(x: torch.Tensor | None, offsets: torch.Tensor | None, poff: torch.Tensor | None,
                            num_experts: int, fields: list[torch.Tensor], spec: str, sharded: bool) -> torch.Tensor:
    """``combine_stats`` of every expert's ``quant_stats`` (module doc); ``fields``: the
    tensor fields of one packed storage or of ``num_experts`` storages, in order."""
    storages = storages_from_spec(spec, fields)
    rows = storages[0].shape2d[1 if storages[0].transposed else 0] * (num_experts if len(storages) > 1 else 1)
    vecs = [quant_stats(xe, _expert_storage(storages, e, s, p), sharded=sharded)
            for e, xe, s, p in _segments(x, offsets, poff, num_experts, rows)]
    return combine_stats(torch.stack(vecs) if vecs else fields[0].new_zeros(0, WIDTH, dtype=torch.float64))


@expert_storage_stats_op.register_fake
def _(x, offsets, poff, num_experts, fields, spec, sharded):
    return fields[0].new_empty(WIDTH, dtype=torch.float64)


@library_op("hybrid_dist::expert_candidate_stats")
def expert_candidate_stats_op(x: torch.Tensor, offsets: torch.Tensor | None, poff: torch.Tensor | None,
                              num_experts: int, candidate: str, tensor_type: str, direction: str,
                              sharded: bool) -> torch.Tensor:
    """``combine_stats`` of each expert's padded slice, zero-padded further to the
    candidate's block rows, quantized by the candidate; experts whose columns do not fit
    its blocks are left out (none left: an unwritten row, ``numel`` 0)."""
    q = CANDIDATES[candidate][tensor_type]
    block_rows = q.direction_quantizer(direction).block_shape(direction)[0]
    vecs = []
    for _, xe, _, _ in _segments(x, offsets, poff, num_experts, x.shape[0]):
        xe = _zero_pad_rows(xe, -(-xe.shape[0] // block_rows) * block_rows)
        if not fits(q, *xe.shape, direction):
            continue
        row, col = q.quantize_storages(xe, rowwise=direction == "rowwise", columnwise=direction == "columnwise")
        vecs.append(quant_stats(xe, row if row is not None else col, sharded=sharded))
    return combine_stats(torch.stack(vecs) if vecs else x.new_zeros(0, WIDTH, dtype=torch.float64))


@expert_candidate_stats_op.register_fake
def _(x, offsets, poff, num_experts, candidate, tensor_type, direction, sharded):
    return x.new_empty(WIDTH, dtype=torch.float64)


def expert_storage_stats(x: torch.Tensor | None, storages: list, *, num_experts: int, offsets=None, poff=None,
                         sharded: bool = False) -> torch.Tensor:
    """float64 ``[WIDTH]`` of ``storages`` (one packed, or one per expert) against ``x``
    (rows by ``offsets`` / ``poff``; None: equal segments), as one operator."""
    fields = [getattr(st, f) for st in storages for f in type(st).TENSOR_FIELDS]
    return expert_storage_stats_op(x, offsets, poff, num_experts, fields, storage_spec(storages[0]), sharded)


def expert_candidate_stats(x: torch.Tensor, candidate: str, tensor_type: str, direction: str, *,
                           num_experts: int, offsets=None, poff=None, sharded: bool = False) -> torch.Tensor:
    """float64 ``[WIDTH]``: the candidate format's rows of every expert's slice of ``x``, combined."""
    return expert_candidate_stats_op(x, offsets, poff, num_experts, candidate, tensor_type, direction, sharded)
