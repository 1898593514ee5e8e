"""FSDP2's gradient copy-in with host work per parameter, not per 2 KiB of gradient.

Before each reduce-scatter FSDP2 packs a module's unsharded gradients into one buffer
``[W, Σ c_i]`` (``W`` ranks; gradient ``i`` of ``d_i`` rows padded to ``⌈d_i / W⌉·W`` and cut
into ``W`` chunks of ``c_i`` elements, cast to the reduce dtype) with ``torch._chunk_cat``.
On CUDA that op builds its kernel's metadata on the host with one entry per 2048 bytes of
output and copies it to the device: host time grows with the gradient's size (24–47 ms per
block of an 8b MoE layer, 1.4B expert parameters, on an H200 host; about 1 ms per 1b
block), during which the GPU waits when the backward is host-bound.

``copy_in`` writes the same buffer with one launch per gradient on CUDA
(``kernels.chunk_copy``: every rank's chunk and its zero padding), elsewhere one strided
``copy_`` per gradient plus a zero fill of the padding where ``d_i`` is not a multiple of
``W``: the bytes of ``torch._chunk_cat``, with host work per parameter. ``install()`` puts
it in FSDP2's place for eager steps (a traced step keeps FSDP2's op); ``uninstall()``
restores FSDP2's.
"""

from __future__ import annotations

import inspect

import torch

__all__ = ["copy_in", "install", "installed", "uninstall"]


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


def _fsdp_collectives():
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    return _fsdp_collectives


def _wrapped(original):
    def foreach_reduce_scatter_copy_in(unsharded_grads, reduce_scatter_input, world_size):
        if torch.compiler.is_compiling():
            return original(unsharded_grads, reduce_scatter_input, world_size)
        copy_in(unsharded_grads, reduce_scatter_input, world_size)

    foreach_reduce_scatter_copy_in.hd_original = original
    return foreach_reduce_scatter_copy_in


def install() -> bool:
    """Replace FSDP2's gradient copy-in by ``copy_in`` (idempotent). False, with nothing
    changed, where this torch's FSDP2 does not call ``foreach_reduce_scatter_copy_in(grads,
    out, world_size)`` from ``foreach_reduce`` (the only form this replaces)."""
    mod = _fsdp_collectives()
    current = getattr(mod, "foreach_reduce_scatter_copy_in", None)
    if current is None:
        return False
    if getattr(current, "hd_original", None) is not None:
        return True
    params = list(inspect.signature(current).parameters)
    src = inspect.getsource(mod.foreach_reduce)
    if params != ["unsharded_grads", "reduce_scatter_input", "world_size"] or \
            "foreach_reduce_scatter_copy_in(unsharded_grads, reduce_scatter_input, world_size)" not in src:
        return False
    mod.foreach_reduce_scatter_copy_in = _wrapped(current)
    return True


def installed() -> bool:
    return getattr(getattr(_fsdp_collectives(), "foreach_reduce_scatter_copy_in", None), "hd_original",
                   None) is not None


def uninstall() -> None:
    """Restore FSDP2's own copy-in."""
    mod = _fsdp_collectives()
    original = getattr(mod.foreach_reduce_scatter_copy_in, "hd_original", None)
    if original is not None:
        mod.foreach_reduce_scatter_copy_in = original
