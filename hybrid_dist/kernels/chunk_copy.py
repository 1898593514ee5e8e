"""``copy_chunks``: one tensor's padded rank chunks into a reduce-scatter buffer, one launch.

For a contiguous ``src`` of ``n`` elements, ``W`` ranks and a chunk of ``c`` elements
(``W · c >= n``), writes for every rank ``k`` and ``0 <= j < c``::

    out[k, off + j] = src.flat[k·c + j]   if k·c + j < n,   else 0

cast to ``out``'s dtype. ``out [W, S]`` may have any row stride (the ranks' slices of one
flat buffer). Program ``(t, k)`` copies elements ``[t·B, (t+1)·B)`` of rank ``k``'s chunk:
contiguous loads and stores. The casts it takes are exact (the same dtype, or fp16 / bf16
to fp32), so the bytes are those of ``torch._chunk_cat``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_dist.kernels._launch import launch

__all__ = ["copy_chunks", "exact_cast"]

_BLOCK = 2048


@triton.jit
def _chunk_copy_kernel(src_ptr, out_ptr, n, c, off, row_stride, BLOCK: tl.constexpr):
    k = tl.program_id(1).to(tl.int64)
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_chunk = j < c
    s = k * c + j
    v = tl.load(src_ptr + s, mask=in_chunk & (s < n), other=0)
    tl.store(out_ptr + k * row_stride + off + j, v.to(out_ptr.dtype.element_ty), mask=in_chunk)


def exact_cast(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether ``copy_chunks`` takes ``src`` → ``dst`` (the casts that are exact)."""
    return src == dst or (dst == torch.float32 and src in (torch.bfloat16, torch.float16))


def copy_chunks(src: torch.Tensor, out: torch.Tensor, off: int, c: int) -> None:
    """``out[k, off:off + c]`` = rank ``k``'s zero-padded chunk of ``src`` (module doc);
    ``src`` contiguous, ``out [W, S]`` with unit stride along S, ``exact_cast`` dtypes."""
    w = out.shape[0]
    if not (src.is_contiguous() and out.stride(1) == 1 and exact_cast(src.dtype, out.dtype)
            and w * c >= src.numel() and off + c <= out.shape[1]):
        raise ValueError(f"copy_chunks: contiguous src of at most W*c elements, out [W, S] with unit stride and an "
                         f"exact cast; got src {tuple(src.shape)} {src.dtype}, out {tuple(out.shape)} strides "
                         f"{out.stride()} {out.dtype}, off {off}, c {c}")
    if c == 0:
        return
    launch(_chunk_copy_kernel, (triton.cdiv(c, _BLOCK), w), src, out, src.numel(), c, off, out.stride(0),
           BLOCK=_BLOCK, num_warps=4)
