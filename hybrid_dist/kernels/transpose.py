"""``transpose_into(dst, src)``: ``dst [C, R] = src [R, C]ᵀ`` for 2D tensors of 1, 2, 4 or 8
byte elements, as one tiled Triton kernel (bitwise a copy: bytes are moved, never
converted).

Why: PyTorch's elementwise copy of a transposed FP8 view runs far below the copy bandwidth
on Hopper (a small fraction of it for an FSDP2 weight). The FSDP2 columnwise transport
(shard ``[K, M/w]`` → ``[M/w, K]`` and back after the gather) and the columnwise write of
fp32-input FP8 quantization are such transposes. Tiles of ``[64, 64]`` are read row-major
and written transposed, so both sides are coalesced.

``src`` may be any 2D view (strides are honoured); ``dst`` must be contiguous with
``dst.shape == src.shape[::-1]`` and the same element size.

``transposed(src)`` while compiling is the operator ``hybrid_dist::transposed_2d``, a
``triton_op``: inductor launches this kernel from its generated code, with the eager path's
arguments, instead of lowering ``src.t().contiguous()`` itself (``docs/design.md`` §7).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_dist.kernels._launch import launch
from hybrid_dist.kernels._traced import kernel_op, traced_launch

_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_TILE = 64


@triton.jit
def transpose_tile(src_ptr, dst_ptr, R, C, s_r, s_c, pid_r, pid_c, TILE: tl.constexpr):
    """Tile ``(pid_r, pid_c)`` of ``dst [C, R] = src [R, C]ᵀ`` (``src`` strides ``s_r, s_c``;
    ``dst`` contiguous)."""
    r = pid_r * TILE + tl.arange(0, TILE)[:, None]
    c = pid_c * TILE + tl.arange(0, TILE)[None, :]
    tile = tl.load(src_ptr + r * s_r + c * s_c, mask=(r < R) & (c < C))
    rt = pid_r * TILE + tl.arange(0, TILE)[None, :]
    ct = pid_c * TILE + tl.arange(0, TILE)[:, None]
    tl.store(dst_ptr + ct * R + rt, tl.trans(tile), mask=(ct < C) & (rt < R))


@triton.jit
def _transpose_kernel(src_ptr, dst_ptr, R, C, s_r, s_c, TILE: tl.constexpr):
    transpose_tile(src_ptr, dst_ptr, R, C, s_r, s_c, tl.program_id(0), tl.program_id(1), TILE)


def transpose_into(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src.t())`` for a contiguous ``dst`` (see the module doc)."""
    if (src.dim() != 2 or dst.shape != src.shape[::-1] or not dst.is_contiguous()
            or src.element_size() != dst.element_size() or src.element_size() not in _VIEW):
        raise ValueError(
            f"transpose_into: needs a 2D src [R, C] and a contiguous dst [C, R] of the same element size "
            f"(1, 2, 4 or 8 bytes); got src {tuple(src.shape)} {src.dtype}, dst {tuple(dst.shape)} {dst.dtype}"
        )
    if torch.compiler.is_compiling():  # inductor generates its own transpose
        return dst.copy_(src.t())
    return _launch_transpose(dst, src, launch)


def _launch_transpose(dst: torch.Tensor, src: torch.Tensor, run) -> torch.Tensor:
    """The kernel's launch for checked ``dst``/``src``, through ``run(kernel, grid, ...)``
    (the eager launcher or ``traced_launch``); bytes are moved as unsigned words."""
    r, c = src.shape
    view = _VIEW[src.element_size()]
    if r == 1 or c == 1:  # a vector: a copy of its bytes (Triton would compile a variant for a 1)
        dst.view(-1).view(view).copy_(src.reshape(-1).view(view))
        return dst
    if r and c:
        run(_transpose_kernel, (triton.cdiv(r, _TILE), triton.cdiv(c, _TILE)),
            src.view(view) if src.dtype != view else src, dst.view(view) if dst.dtype != view else dst,
            r, c, src.stride(0), src.stride(1), TILE=_TILE)
    return dst


def _transposed_fake(src: torch.Tensor) -> torch.Tensor:
    return src.new_empty((src.shape[1], src.shape[0]))


@kernel_op("hybrid_dist::transposed_2d", fake=_transposed_fake)
def transposed_op(src: torch.Tensor) -> torch.Tensor:
    """``src [R, C]`` (2D, 1/2/4/8-byte elements) → ``src.t().contiguous()`` by the tiled
    kernel, for compiled graphs (the kernel and arguments of the eager path)."""
    return _launch_transpose(src.new_empty((src.shape[1], src.shape[0])), src, traced_launch)


def transposed(src: torch.Tensor) -> torch.Tensor:
    """``src.t().contiguous()`` through the kernel (while compiling: ``transposed_op``)."""
    if torch.compiler.is_compiling():
        return transposed_op(src)
    return transpose_into(torch.empty((src.shape[1], src.shape[0]), dtype=src.dtype, device=src.device), src)
