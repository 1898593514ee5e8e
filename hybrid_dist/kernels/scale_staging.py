"""Block scales written per program into a staging buffer, then moved into place in one
launch (the MXFP8 words kernel).

Why: a quantize program of a ``[BM, BK]`` tile owns ``BM`` rows × ``C`` bytes of the
rowwise scale tensor ``[M, S]`` (and ``BK`` rows × ``BM/block`` bytes of the columnwise
one). Written in place, every 32-byte sector of a scale tensor takes its bytes from 4 to 16
programs that run at different times, and those partial-sector writes bound the MXFP8
kernel. Staged, each program's scale bytes are contiguous. The NVFP4 1×16 kernels, bound
by their instructions instead, ran no faster staged, so they store in place.

Layout: scale ``[r, c]`` of a ``[R, S]`` scale tensor lives at byte
``(c // U)·R·U + r·U + c % U`` of its stage: ``[ceil(S/U), R]`` units of ``U`` bytes
(``U`` = the bytes one program writes per scale row, at most 8). Moving it into place is a
transpose of units: ``dst [R, S] = stageᵀ`` (``unstage``), bitwise a copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_dist.kernels._jit_common import cdiv
from hybrid_dist.kernels._launch import launch
from hybrid_dist.kernels.transpose import transpose_tile, transposed

_UNIT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_TILE = 64


def stage_unit(bytes_per_program_row: int) -> int:
    """``U``: the bytes a program writes per scale row, capped at 8 (one int64)."""
    return min(bytes_per_program_row, 8)


def new_stage(rows: int, cols: int, unit: int, device) -> torch.Tensor:
    """The stage of a ``[rows, cols]`` uint8 scale tensor: ``[ceil(cols/unit), rows]`` units."""
    return torch.empty((cdiv(cols, unit), rows), dtype=_UNIT[unit], device=device)


@triton.jit
def staged(ptr, r, c, R, U: tl.constexpr):
    """Pointer to scale ``[r, c]`` of an ``[R, S]`` scale tensor in its stage (uint8 ``ptr``)."""
    return ptr + (c // U) * (R * U) + r * U + c % U


@triton.jit
def _unstage_kernel(a_src, a_dst, a_T, a_R, b_src, b_dst, b_T, b_R, TWO: tl.constexpr, TILE: tl.constexpr):
    """``a_dst = a_srcᵀ`` and, if ``TWO``, ``b_dst = b_srcᵀ``: the first programs do ``a``."""
    pid = tl.program_id(0)
    n_a = tl.cdiv(a_T, TILE) * tl.cdiv(a_R, TILE)
    if pid < n_a:
        n_r = tl.cdiv(a_R, TILE)
        transpose_tile(a_src, a_dst, a_T, a_R, a_R, 1, pid // n_r, pid % n_r, TILE)
    elif TWO:
        n_r = tl.cdiv(b_R, TILE)
        transpose_tile(b_src, b_dst, b_T, b_R, b_R, 1, (pid - n_a) // n_r, (pid - n_a) % n_r, TILE)


def unstage(*pairs: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Each ``(dst, stage)``: ``dst [R, S]`` uint8 (contiguous) from its stage ``[T, R]``.
    Where the units tile ``dst`` exactly (``S % U == 0``) one launch moves them all (tiles of
    ``transpose.transpose_tile``); else, and for a stage of one row or column, the stage is
    transposed (``transpose.transposed``, a copy for a vector) and its first ``S`` columns
    copied."""
    exact = []
    for dst, stage in pairs:
        if not dst.numel():
            continue
        if dst.shape[1] % stage.element_size() or min(stage.shape) == 1:  # a vector: transposed() copies it
            dst.copy_(transposed(stage).view(torch.uint8)[:, :dst.shape[1]])
        else:
            exact.append((dst.view(stage.dtype), stage))
    if exact:
        _launch(exact)


def _launch(pairs):
    (a_dst, a), (b_dst, b) = pairs[0], pairs[-1]
    n = sum(cdiv(s.shape[0], _TILE) * cdiv(s.shape[1], _TILE) for _, s in pairs)
    launch(_unstage_kernel, (n,), a, a_dst, a.shape[0], a.shape[1], b, b_dst, b.shape[0], b.shape[1],
           TWO=len(pairs) == 2, TILE=_TILE, num_warps=4)
