"""Sequence-parallel collectives and the fprop GEMMs next to them, in overlapped chunks.

``gather_gemm(row_local, w_row, group, chunks, ...)`` computes what
``gemm_nt(all_gather(row_local), w_row)`` computes — ``y [M, N/tp]`` of a column-parallel
layer from this rank's quantized rows ``[M/tp, K]`` — as ``chunks`` all-gathers of
``M/(tp·chunks)`` rows per rank, all issued at once, each followed (once it arrived) by
its GEMM: chunk ``c``'s GEMM runs while the later chunks travel. Chunk ``c`` gathers rows
``c·mc … (c+1)·mc`` of every rank's shard (a contiguous slice of the local rows), so its
GEMM writes rows ``r·m + c·mc …`` of ``y`` for every rank ``r``; the chunks are
interleaved back into row order (one copy of ``y``).

``gemm_reduce_scatter(x_row, w_row, group, chunks, ...)`` computes what
``reduce_scatter(gemm_nt(x_row, w_row))`` computes — ``y [M/tp, N]``, this rank's rows of
the sum over ranks of ``x [M, K/tp] · W_local [N, K/tp]ᵀ`` — as ``chunks`` GEMMs, each
followed by its reduce-scatter, so the reduce-scatter of chunk ``c`` runs (on NCCL's
stream) while chunk ``c + 1``'s GEMM runs.

Layout: with ``m = M / tp`` rows per rank and ``mc = m / chunks``, chunk ``c`` is the rows
``r·m + c·mc … r·m + (c+1)·mc`` of every rank ``r``, taken rank-major (a ``[tp·mc, K/tp]``
copy of the operand's bytes); its reduce-scatter leaves this rank rows ``c·mc …
(c+1)·mc`` of its own block, and the chunks concatenate to the unchunked result. Each
output element is the same dot product over the same ``K/tp`` values and the same
reduction over ranks, so the result equals the unchunked one wherever the GEMM's
accumulation order does not depend on ``M`` (asserted bitwise on CPU; on the GPU the
benchmark reports the difference).

Eagerly the reduce-scatters are asynchronous work handles, waited after the last GEMM;
while compiling they are functional collectives whose waits sit at the concatenation.
Chunkable operands: a rowwise per-tensor FP8 or high-precision storage (one data field
with rows on dim 0 and at most a per-tensor scale, which every rank shares: the shard was
quantized with the group amax); other formats run unchunked. The gathered bytes are those
of the unchunked gather, so the same bitwise statement holds for ``gather_gemm``.
"""

from __future__ import annotations

import torch

from hybrid_dist import gemm
from hybrid_dist.formats.float8 import Float8Quantizer, Float8Storage
from hybrid_dist.formats.identity import IdentityQuantizer, IdentityStorage
from hybrid_dist.tensor_parallel import _comm
from hybrid_dist.tensor_parallel.gather import gather_storages, reduce_scatter_along_first_dim


def chunkable(x_row, rows_per_chunk_set: int, chunks: int) -> bool:
    """True when ``x_row``'s rows split into ``chunks`` pieces of ``rows_per_chunk_set``-row
    multiples (``gemm_reduce_scatter``: the world size; ``gather_gemm``: 1)."""
    return (chunks > 1 and isinstance(x_row, (Float8Storage, IdentityStorage)) and not x_row.transposed
            and x_row.data.dim() == 2 and x_row.data.shape[0] % (rows_per_chunk_set * chunks) == 0)


def gathers_in_chunks(quantizer, m_local: int, cfg) -> bool:
    """True when a column-parallel SP input of ``m_local`` rows per rank is gathered by
    ``gather_gemm``: ``cfg.overlap_chunks`` set, a quantized gather (path (b)) and a rowwise
    direction whose storage is chunkable (per-tensor FP8 or high precision)."""
    rq = quantizer.direction_quantizer("rowwise")
    return (cfg.overlap_chunks > 1 and cfg.gather_path != "high_precision"
            and isinstance(rq, (Float8Quantizer, IdentityQuantizer)) and m_local % cfg.overlap_chunks == 0)


def gather_gemm(row_local, w_row, group, chunks: int, *, out_dtype, config) -> torch.Tensor:
    """``y [M, N/tp]`` = the gathered rows of ``row_local [M/tp, K]`` · ``w_rowᵀ``, in ``chunks``
    overlapped all-gather + GEMM steps (module note; ``chunkable(row_local, 1, chunks)``)."""
    world = _comm.group_size(group)
    m = row_local.data.shape[0]
    mc = m // chunks
    handles = [gather_storages({"rowwise": row_local.with_tensors({"data": row_local.data[c * mc:(c + 1) * mc]})},
                               group, async_op=True) for c in range(chunks)]
    parts = []
    for h in handles:
        part = gemm.gemm_nt(h.wait()["rowwise"], w_row, out_dtype=out_dtype, config=config)
        parts.append(part.view(world, mc, part.shape[-1]))
    return torch.stack(parts, dim=1).reshape(world * m, parts[0].shape[-1])


def _chunk_rows(x_row, world: int, chunks: int, c: int):
    """Rows ``c·mc … (c+1)·mc`` of every rank's block, rank-major (module note)."""
    data = x_row.data
    m = data.shape[0] // world
    mc = m // chunks
    rows = data.view(world, m, data.shape[1])[:, c * mc:(c + 1) * mc].reshape(world * mc, data.shape[1])
    return x_row.with_tensors({"data": rows})


def gemm_reduce_scatter(x_row, w_row, group, chunks: int, *, out_dtype, config) -> torch.Tensor:
    """``y [M/tp, N]``: this rank's rows of the group sum of ``x_row [M, K/tp] · w_rowᵀ``, in
    ``chunks`` overlapped GEMM + reduce-scatter steps (module note; ``chunkable`` must hold)."""
    world = _comm.group_size(group)
    handles = []
    for c in range(chunks):
        part = gemm.gemm_nt(_chunk_rows(x_row, world, chunks, c), w_row, out_dtype=out_dtype, config=config)
        handles.append(reduce_scatter_along_first_dim(part, group, async_op=True))
    return torch.cat([h.wait() for h in handles])
