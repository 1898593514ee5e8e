"""FSDP2's gradient copy-in with host work per parameter, not per 2 KiB of gradient.

Before each reduce-scatter FSDP2 packs a module's unsharded gradients into one buffer
``[W, Σ c_i]`` (``W`` ranks; gradient ``i`` of ``d_i`` rows padded to ``⌈d_i / W⌉·W`` and cut
into ``W`` chunks of ``c_i`` elements, cast to the reduce dtype) with ``torch._chunk_cat``,
whose CUDA path builds one host metadata entry per 2048 bytes of output (why that matters:
``docs/design.md`` §7).

``copy_in`` writes the same buffer with one launch per gradient on CUDA
(``kernels.chunk_copy``: every rank's chunk and its zero padding), elsewhere one strided
``copy_`` per gradient plus a zero fill of the padding where ``d_i`` is not a multiple of
``W``: the bytes of ``torch._chunk_cat``, with host work per parameter. FSDP2 offers no
extension point for its copy-in; the launcher puts ``copy_in`` in its place unless run
with ``--fsdp-copy-in torch`` (``launch/fsdp_copy_in.py``).
"""

from __future__ import annotations

import torch

__all__ = ["copy_in"]


def copy_in(grads: list[torch.Tensor], out: torch.Tensor, world_size: int) -> None:
    """``torch._chunk_cat(grads, dim=0, num_chunks=world_size, out=out.view(world_size, -1))``
    (module doc): ``out`` holds exactly the padded chunks of every gradient, in order."""
    w = world_size
    dst_all = out.view(w, -1)
    layout = []  # (gradient, rows per chunk, elements per row)
    for g in grads:
        if g.shape[0]:  # chunk_cat pads an empty dim 0 to zero rows
            layout.append((g, -(-g.shape[0] // w), g.numel() // g.shape[0]))
    total = sum(r * t for _, r, t in layout)
    if total != dst_all.shape[1]:
        raise ValueError(f"fsdp2 copy_in: the gradients fill {total} of {dst_all.shape[1]} elements per rank")
    kernel = _chunk_kernel(out)
    off = 0
    for g, per_chunk_rows, trail in layout:
        c = per_chunk_rows * trail
        if kernel is not None and kernel.exact_cast(g.dtype, out.dtype):
            kernel.copy_chunks(g.contiguous(), dst_all, off, c)
            off += c
            continue
        dst = dst_all[:, off:off + c]
        off += c
        full = g.shape[0] // per_chunk_rows  # ranks whose chunk is all real rows
        if full:
            dst[:full].copy_(g[:full * per_chunk_rows].reshape(full, c))
        if full < w:
            rem = g.shape[0] - full * per_chunk_rows  # real rows of rank `full` (< per_chunk_rows)
            if rem:
                dst[full, :rem * trail].copy_(g[full * per_chunk_rows:].reshape(-1))
            dst[full, rem * trail:].zero_()
            dst[full + 1:].zero_()


def _chunk_kernel(out: torch.Tensor):
    """``kernels.chunk_copy`` where it serves ``out`` (CUDA, Triton, eager), else None."""
    from hybrid_dist.kernels import kernels_serve

    if not kernels_serve(out):
        return None
    from hybrid_dist.kernels import chunk_copy

    return chunk_copy
