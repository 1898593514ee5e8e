"""Per-expert per-tensor FP8 cast of token rows into the packed layout, both directions
from one read (Triton).

Legend: T input rows, K columns, E experts, C the packed capacity, ``off [E+1]`` /
``poff [E+1]`` the cumulative token / padded counts, ``row_expert [C]`` each packed row's
expert (E past the last one), ``scale [E]`` fp32 the encode scale of each expert
(``device_split``).

    packed row p of expert e = row_expert[p] holds token t = p - poff[e] + off[e]
        when t < off[e+1], else it is padding (zeros)
    row [C, K]:  row[p, :] = cast_fp8(x[t, :] · scale[e])   (0 for padding rows)
    col [K, C]:  rowᵀ

Each program owns packed rows ``[BM]`` × columns ``[BK]``: it gathers their tokens (rows
of a tile are contiguous tokens except at expert boundaries), casts and stores the tile,
and casts and stores its in-register transpose (the bf16 tile transposed, then cast with
the per-column scales: the same bytes as transposing the codes, and faster) — so the
columnwise buffer costs no second pass and no buffer is zero-filled (padding rows are
written as zero bytes). The product is one fp32
multiply and the cast saturates and rounds to nearest even, as
``numerics.cast_to_fp8(x_pad · scale_rows)``: bitwise the torch form on the GPU
(``tests/moe/test_device_split`` GPU case) and, under the Triton interpreter, on inputs
whose casts are exact (``tests/kernels/fp8/test_rows.py``). bf16 inputs only (the
in-register transpose is tested for bf16 tiles only; other dtypes use the torch form).

While ``torch.compile`` traces, ``expert_amax`` and ``fp8_rows`` launch the same kernels as
the ``kernel_op``s ``hybrid_dist::fp8_expert_amax`` / ``hybrid_dist::fp8_packed_rows``, so a
compiled packed split is eager's bytes from one read (no traced cast, no 1-byte transpose copy).

``place_codes`` moves rows that are already codes (the expert-parallel receiver's FP8
rows, as bytes) into the same layout: ``row[p] = codes[src[t]]`` (``src`` the identity by
default; the receiver's regroup from source-major to expert-major order otherwise, so the
received rows are not gathered first; zero bytes for padding) and ``col = rowᵀ``, from one
read, in place of a zero fill, an ``index_copy`` and a transpose.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_dist.formats.numerics import FP8_MAX
from hybrid_dist.kernels._jit_common import cast_fp8, eager_or_op
from hybrid_dist.kernels._launch import launch
from hybrid_dist.kernels._traced import kernel_op, traced_launch

__all__ = ["expert_amax", "fp8_rows", "place_codes"]

# 64x128 tiles, 4 warps, columnwise from the transposed bf16 tile (faster than 8 warps with
# the 8-bit transpose of the codes, the same bytes: docs/design.md §8)
_BM, _BK = 64, 128  # also the tile of the per-expert amax pass
_PLACE_TILE = 64  # place_codes: 64x64 byte tiles transposed in registers, as kernels.transpose's


@triton.jit
def _fp8_packed_kernel(x_ptr, scale_ptr, row_expert_ptr, off_ptr, poff_ptr, row_ptr, col_ptr, C, K, E, stride_t,
                       FMAX: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr, BM: tl.constexpr,
                       BK: tl.constexpr):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rp = pid_m * BM + tl.arange(0, BM)  # packed rows
    e = tl.load(row_expert_ptr + rp, mask=rp < C, other=E)
    real = e < E
    tok = rp - tl.load(poff_ptr + e, mask=real, other=0) + tl.load(off_ptr + e, mask=real, other=0)
    real &= tok < tl.load(off_ptr + e + 1, mask=real, other=0)
    s = tl.load(scale_ptr + e, mask=real, other=1.0)
    rk = pid_k * BK + tl.arange(0, BK)[None, :]
    x = tl.load(x_ptr + tok[:, None].to(tl.int64) * stride_t + rk, mask=real[:, None] & (rk < K), other=0.0)
    if ROW:
        q = cast_fp8(x.to(tl.float32) * s[:, None], FMAX, row_ptr.dtype.element_ty)
        tl.store(row_ptr + rp[:, None].to(tl.int64) * K + rk, q, mask=(rp[:, None] < C) & (rk < K))
    if COL:  # the 16-bit tile transposed, then cast: the bytes of tl.trans(q), faster (module doc)
        ck = pid_k * BK + tl.arange(0, BK)[:, None]
        cp = pid_m * BM + tl.arange(0, BM)[None, :]
        q_t = cast_fp8(tl.trans(x).to(tl.float32) * s[None, :], FMAX, col_ptr.dtype.element_ty)
        tl.store(col_ptr + ck.to(tl.int64) * C + cp, q_t, mask=(ck < K) & (cp < C))


@triton.jit
def _place_codes_kernel(x_ptr, row_expert_ptr, off_ptr, poff_ptr, src_ptr, row_ptr, col_ptr, C, K, E, stride_t,
                        SRC: tl.constexpr, COL: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rp = pid_m * BM + tl.arange(0, BM)  # packed rows; their tokens as in _fp8_packed_kernel
    e = tl.load(row_expert_ptr + rp, mask=rp < C, other=E)
    real = e < E
    tok = rp - tl.load(poff_ptr + e, mask=real, other=0) + tl.load(off_ptr + e, mask=real, other=0)
    real &= tok < tl.load(off_ptr + e + 1, mask=real, other=0)
    if SRC:  # the token's row in x
        tok = tl.load(src_ptr + tok, mask=real, other=0)
    rk = pid_k * BK + tl.arange(0, BK)[None, :]
    b = tl.load(x_ptr + tok[:, None].to(tl.int64) * stride_t + rk, mask=real[:, None] & (rk < K), other=0)
    tl.store(row_ptr + rp[:, None].to(tl.int64) * K + rk, b, mask=(rp[:, None] < C) & (rk < K))
    if COL:
        ck = pid_k * BK + tl.arange(0, BK)[:, None]
        cp = pid_m * BM + tl.arange(0, BM)[None, :]
        tl.store(col_ptr + ck.to(tl.int64) * C + cp, tl.trans(b), mask=(ck < K) & (cp < C))


@triton.jit(do_not_specialize=["T"])  # an expert-parallel receiver's row count changes every step
def _expert_amax_kernel(x_ptr, eid_ptr, amax_ptr, T, K, stride_t, BM: tl.constexpr, BK: tl.constexpr):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rt = pid_m * BM + tl.arange(0, BM)
    rk = pid_k * BK + tl.arange(0, BK)[None, :]
    x = tl.load(x_ptr + rt[:, None].to(tl.int64) * stride_t + rk, mask=(rt[:, None] < T) & (rk < K), other=0.0)
    row_max = tl.max(tl.abs(x), axis=1).to(tl.float32)  # in x's dtype: exact (a max of its values)
    eid = tl.load(eid_ptr + rt, mask=rt < T, other=-1)
    e_last = tl.max(eid, 0)
    e_first = tl.min(tl.where(rt < T, eid, e_last), 0)
    for e in range(e_first, e_last + 1):  # rows are sorted by expert: usually one or two experts
        tl.atomic_max(amax_ptr + e, tl.max(tl.where(eid == e, row_max, 0.0), 0), sem="relaxed")


def _expert_amax(x: torch.Tensor, expert_of_row: torch.Tensor, num_experts: int, run=None) -> torch.Tensor:
    """fp32 ``[E]``: ``max |x[t]|`` over the rows ``t`` of each expert (0 for an expert with
    none); ``x [T, K]`` unit stride along K, ``expert_of_row [T]`` int, sorted (tokens
    grouped by expert). One read of ``x`` in tiles; each tile max-reduces its rows per
    expert and adds one relaxed atomic max per expert it holds. Exact (a max)."""
    t, k = x.shape
    amax = torch.zeros(num_experts, dtype=torch.float32, device=x.device)
    if t and k:
        grid = (triton.cdiv(t, _BM), triton.cdiv(k, _BK))
        (run or launch)(_expert_amax_kernel, grid, x, expert_of_row.contiguous(), amax, t, k, max(x.stride(0), 1),
                        BM=_BM, BK=_BK, num_warps=4)
    return amax


def _expert_amax_fake(x, expert_of_row, num_experts):
    return x.new_empty(num_experts, dtype=torch.float32)


@kernel_op("hybrid_dist::fp8_expert_amax", fake=_expert_amax_fake)
def expert_amax_op(x: torch.Tensor, expert_of_row: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``expert_amax`` for compiled graphs: the same kernel and arguments."""
    return _expert_amax(x, expert_of_row, num_experts, traced_launch)


expert_amax = eager_or_op(expert_amax_op, _expert_amax)


def fp8_rows(x: torch.Tensor, scale: torch.Tensor, row_expert: torch.Tensor, offsets: torch.Tensor,
             padded_offsets: torch.Tensor, dtype: torch.dtype, *, rowwise: bool,
             columnwise: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(row [C, K] or None, col [K, C] or None)`` fp8 (module doc); ``x [T, K]`` bf16 with
    unit stride along K, ``scale [E]`` fp32, ``row_expert [C]``, ``offsets`` /
    ``padded_offsets [E+1]`` int64, all on one device."""
    if not (rowwise or columnwise):
        return None, None
    args = (x, scale, row_expert, offsets, padded_offsets, dtype, rowwise, columnwise)
    row, col = fp8_rows_op(*args) if torch.compiler.is_compiling() else _fp8_rows(*args, launch)
    return (row if rowwise else None), (col if columnwise else None)


def _fp8_rows_buffers(x, row_expert, dtype, rowwise, columnwise):
    c, k = row_expert.numel(), x.shape[1]
    return (x.new_empty((c, k) if rowwise else (0, 0), dtype=dtype),
            x.new_empty((k, c) if columnwise else (0, 0), dtype=dtype))


def _fp8_rows(x, scale, row_expert, offsets, padded_offsets, dtype, rowwise, columnwise, run):
    c, k, e = row_expert.numel(), x.shape[1], scale.numel()
    row, col = _fp8_rows_buffers(x, row_expert, dtype, rowwise, columnwise)
    if c and k:
        grid = (triton.cdiv(c, _BM), triton.cdiv(k, _BK))
        run(_fp8_packed_kernel, grid, x, scale.float().contiguous(), row_expert.contiguous(),
            offsets.contiguous(), padded_offsets.contiguous(), row, col, c, k, e, max(x.stride(0), 1),
            FMAX=FP8_MAX[dtype], ROW=rowwise, COL=columnwise, BM=_BM, BK=_BK, num_warps=4)
    return row, col


def _fp8_rows_fake(x, scale, row_expert, offsets, padded_offsets, dtype, rowwise, columnwise):
    return _fp8_rows_buffers(x, row_expert, dtype, rowwise, columnwise)


@kernel_op("hybrid_dist::fp8_packed_rows", fake=_fp8_rows_fake)
def fp8_rows_op(x: torch.Tensor, scale: torch.Tensor, row_expert: torch.Tensor, offsets: torch.Tensor,
                padded_offsets: torch.Tensor, dtype: torch.dtype, rowwise: bool,
                columnwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_rows`` for compiled graphs (an absent direction is an empty ``[0, 0]``): the same
    kernel and arguments."""
    return _fp8_rows(x, scale, row_expert, offsets, padded_offsets, dtype, rowwise, columnwise, traced_launch)


def place_codes(codes: torch.Tensor, row_expert: torch.Tensor, offsets: torch.Tensor, padded_offsets: torch.Tensor,
                *, columnwise: bool, src: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(row [C, K], col [K, C] or None)`` uint8 (module doc): the 1-byte ``codes [T, K]``
    (unit stride along K) placed in the packed layout of ``row_expert [C]`` and ``offsets``
    / ``padded_offsets [E+1]``, token t read from row ``src[t]`` (``src [T]`` int64; None:
    row t, the rows sorted by expert); bitwise ``index_copy`` of ``codes[src]`` into zeros,
    then a transpose. View the results as the codes' dtype."""
    c, k, e = row_expert.numel(), codes.shape[1], offsets.numel() - 1
    x = codes.view(torch.uint8)
    row = torch.empty((c, k), dtype=torch.uint8, device=codes.device)
    col = torch.empty((k, c) if columnwise else (0, 0), dtype=torch.uint8, device=codes.device)
    if c and k:
        grid = (triton.cdiv(c, _PLACE_TILE), triton.cdiv(k, _PLACE_TILE))
        src_arg = offsets if src is None else src.contiguous()  # an unread placeholder without src
        launch(_place_codes_kernel, grid, x, row_expert.contiguous(), offsets.contiguous(),
               padded_offsets.contiguous(), src_arg, row, col, c, k, e, max(x.stride(0), 1), SRC=src is not None,
               COL=columnwise, BM=_PLACE_TILE, BK=_PLACE_TILE, num_warps=4)
    return row, (col if columnwise else None)
