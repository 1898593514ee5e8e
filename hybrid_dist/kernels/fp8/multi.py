"""Per-tensor FP8 (current scaling) of N tensors in a constant number of launches.

* ``multi_amax_into``: ``out[j_i] = max(out[j_i], max|x_i|)`` (fp32) for N 2D tensors of one
  dtype, any shapes, in one launch.
* ``multi_fp8_cast_into``: casts each ``x_i`` with the scale of ``amax[j_i]`` into its
  rowwise ``[M, K]`` and/or columnwise ``[K, M]`` fp8 buffer and writes ``scale_inv = 1/scale``
  into each direction's ``scale_inv``: bitwise ``fp8.tensor.quantize_fp8_tensor_into`` of each
  (the same tile, scale formula and cast). One launch from bf16 / fp16 inputs; from fp32
  inputs with both directions two: the rowwise cast, then a launch that transposes the
  rowwise codes it wrote into the columnwise buffers (``fp8.tensor``'s note on fp32 inputs),
  reading 1 byte per element instead of 4.

Layout: a pointer table, int64. The amax table is ``[N, 5]`` rows ``(x, M, K, row stride of
x, j)``; grid ``(N, P)``, program ``(i, p)`` reducing tiles ``p, p + P, ...`` of tensor ``i``
(``BM × BK``), ``P`` the largest tile count capped at ``_MAX_PROGRAMS``. The cast table is
``[N, 9]`` rows that add ``(row data, col data, row scale_inv, col scale_inv)`` (0 for an
absent direction), holding ``data_ptr()``s that the kernels cast back to typed pointers,
followed by two ``[N + 1]`` prefix sums of tile counts (cast tiles, then transpose tiles):
one program per tile of all tensors, which finds its tensor by a binary search over them.
Where every address, ``M``, ``K`` and row stride is a multiple of 16 the kernels say so to
the compiler (``ALIGNED``), which then moves 16 bytes per access; the transpose of 1-byte
codes runs at the copy rate only with that (H200, the 8b's 28 layer weights of 4 blocks
from fp32: rowwise cast 1.82 → 0.99 ms, transpose 2.01 → 0.45 ms against a grid-strided
loop over each tensor's tiles).

A table depends only on its integers, so tables are cached by them (a reallocated buffer
has another address, hence another table); a new one costs one pinned host-to-device copy
that does not wait for the device.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from hybrid_dist.formats.numerics import FP8_MAX
from hybrid_dist.kernels._jit_common import cast_fp8, cdiv, div_rn, per_block_scale
from hybrid_dist.kernels._launch import launch
from hybrid_dist.kernels.transpose import transpose_tile

_BM, _BK = 64, 128  # fp8.tensor's tile
_MAX_PROGRAMS = 1024  # programs per tensor; a larger tensor loops over its tiles
_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
       torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}


@triton.jit
def _multi_amax_kernel(tab_ptr, out_ptr, X_DTYPE: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    i, p = tl.program_id(0), tl.program_id(1)
    e = tab_ptr + i * 5
    x_ptr = tl.load(e).to(tl.pointer_type(X_DTYPE))
    m, k, stride_m = tl.load(e + 1), tl.load(e + 2), tl.load(e + 3)
    out_ptr += tl.load(e + 4)
    n_k = tl.cdiv(k, BK)
    for tile in range(p, tl.cdiv(m, BM) * n_k, tl.num_programs(1)):
        rm = (tile // n_k) * BM + tl.arange(0, BM)[:, None]
        rk = (tile % n_k) * BK + tl.arange(0, BK)[None, :]
        x = tl.load(x_ptr + rm * stride_m + rk, mask=(rm < m) & (rk < k), other=0.0)
        tl.atomic_max(out_ptr, sem="relaxed", val=tl.max(tl.abs(x.to(tl.float32))))


@triton.jit
def _tensor_of(starts_ptr, pid, n, LOG_N: tl.constexpr):
    """``i`` with ``starts[i] <= pid < starts[i + 1]`` (``starts``: ``n + 1`` ascending tile
    offsets, ``LOG_N >= log2(n)``), by binary search."""
    lo = pid * 0
    hi = lo + n
    for _ in tl.static_range(LOG_N):
        mid = (lo + hi) // 2
        right = tl.load(starts_ptr + mid) <= pid
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    return lo


@triton.jit
def _multi_cast_kernel(tab_ptr, amax_ptr, n, X_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr, FMAX: tl.constexpr,
                       EPS: tl.constexpr, POW2: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr,
                       COL_SCALE_INV: tl.constexpr, LOG_N: tl.constexpr, ALIGNED: tl.constexpr,
                       BM: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    starts = tab_ptr + n * 9
    i = _tensor_of(starts, pid, n, LOG_N)
    tile = pid - tl.load(starts + i)
    e = tab_ptr + i * 9
    x_ptr = tl.load(e).to(tl.pointer_type(X_DTYPE))
    m, k, stride_m = tl.load(e + 1), tl.load(e + 2), tl.load(e + 3)
    row_ptr = tl.load(e + 5).to(tl.pointer_type(OUT_DTYPE))
    col_ptr = tl.load(e + 6).to(tl.pointer_type(OUT_DTYPE))
    if ALIGNED:
        m, k, stride_m = tl.multiple_of(m, 16), tl.multiple_of(k, 16), tl.multiple_of(stride_m, 16)
        x_ptr, row_ptr, col_ptr = tl.multiple_of(x_ptr, 16), tl.multiple_of(row_ptr, 16), tl.multiple_of(col_ptr, 16)
    scale = per_block_scale(tl.load(amax_ptr + tl.load(e + 4)), FMAX, EPS, POW2)
    if tile == 0:
        scale_inv = div_rn(tl.zeros_like(scale) + 1.0, scale)
        if ROW:
            tl.store(tl.load(e + 7).to(tl.pointer_type(tl.float32)), scale_inv)
        if COL_SCALE_INV:  # also when the transpose kernel writes the columnwise codes
            tl.store(tl.load(e + 8).to(tl.pointer_type(tl.float32)), scale_inv)
    n_k = tl.cdiv(k, BK)
    rm = (tile // n_k) * BM + tl.arange(0, BM)[:, None]
    rk = (tile % n_k) * BK + tl.arange(0, BK)[None, :]
    mask = (rm < m) & (rk < k)
    x = tl.load(x_ptr + rm * stride_m + rk, mask=mask, other=0.0).to(tl.float32)
    q = cast_fp8(x * scale, FMAX, OUT_DTYPE)
    if ROW:
        tl.store(row_ptr + rm * k + rk, q, mask=mask)
    if COL:  # columnwise stored [K, M]: element (m, k) goes to col[k, m]
        rm_t = (tile // n_k) * BM + tl.arange(0, BM)[None, :]
        rk_t = (tile % n_k) * BK + tl.arange(0, BK)[:, None]
        tl.store(col_ptr + rk_t * m + rm_t, tl.trans(q), mask=(rk_t < k) & (rm_t < m))


@triton.jit
def _multi_transpose_kernel(tab_ptr, n, LOG_N: tl.constexpr, ALIGNED: tl.constexpr, TILE: tl.constexpr):
    """The columnwise codes ``[K, M]`` of every entry from the rowwise ``[M, K]`` ones the
    cast kernel wrote: bytes moved, one ``TILE × TILE`` tile per program."""
    pid = tl.program_id(0)
    starts = tab_ptr + n * 10 + 1
    i = _tensor_of(starts, pid, n, LOG_N)
    tile = pid - tl.load(starts + i)
    e = tab_ptr + i * 9
    m, k = tl.load(e + 1), tl.load(e + 2)
    src = tl.load(e + 5).to(tl.pointer_type(tl.uint8))
    dst = tl.load(e + 6).to(tl.pointer_type(tl.uint8))
    if ALIGNED:
        m, k = tl.multiple_of(m, 16), tl.multiple_of(k, 16)
        src, dst = tl.multiple_of(src, 16), tl.multiple_of(dst, 16)
    n_k = tl.cdiv(k, TILE)
    transpose_tile(src, dst, m, k, k, 1, tile // n_k, tile % n_k, TILE)


_TABLES: dict[tuple, torch.Tensor] = {}  # (device, stream, ints) -> the int64 table on device
_MAX_TABLES = 16


def _table(ints: list[int], device: torch.device) -> torch.Tensor:
    """The int64 table of ``ints`` on ``device``, cached by its integers (module note)."""
    stream = torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0
    key = (device, stream, tuple(ints))
    tab = _TABLES.get(key)
    if tab is None:
        if device.type == "cuda":  # pinned source, no wait for the device's queue
            tab = torch.tensor(ints, dtype=torch.int64, device="cpu").pin_memory().to(device, non_blocking=True)
        else:  # the Triton interpreter's CPU tensors
            tab = torch.tensor(ints, dtype=torch.int64, device=device)
        if len(_TABLES) >= _MAX_TABLES:
            del _TABLES[next(iter(_TABLES))]
        _TABLES[key] = tab
    return tab


def rows_of(x: torch.Tensor) -> tuple[int, int, int] | None:
    """``(M, K, row stride)`` of ``x`` read as 2D ``[M, K]`` without a copy (unit stride along
    K), or None where that needs one."""
    if x.dim() < 2:
        return (1, x.numel(), 0) if x.dim() == 0 or x.stride(0) == 1 or x.numel() <= 1 else None
    k = x.shape[-1]
    if x.is_contiguous():
        return (x.numel() // k if k else 0), k, k
    if x.dim() == 2 and x.stride(1) == 1:
        return x.shape[0], k, x.stride(0)
    return None


def multi_amax_into(xs: Sequence[torch.Tensor], rows: Sequence[tuple[int, int, int]], out: torch.Tensor,
                    slots: Sequence[int]) -> None:
    """One launch: ``out[slots[i]] = max(out[slots[i]], max|xs[i]|)``, ``rows[i]`` being
    ``rows_of(xs[i])``. ``xs``: one dtype (fp32, bf16 or fp16), ``out``'s device; ``out``: fp32."""
    if not xs:
        return
    ints, most = [], 0
    for x, (m, k, s), j in zip(xs, rows, slots):
        ints += (x.data_ptr(), m, k, s, j)
        most = max(most, cdiv(m, _BM) * cdiv(k, _BK))
    if most:
        launch(_multi_amax_kernel, (len(xs), min(most, _MAX_PROGRAMS)), _table(ints, out.device), out,
               X_DTYPE=_TL[xs[0].dtype], BM=_BM, BK=_BK, num_warps=4)


_CAST_TILE = {False: (32, 128, 4), True: (64, 128, 4)}  # BM, BK, warps; True: it writes the columnwise
_T_TILE = 128  # the codes' transpose: tile side (4 warps)


def multi_fp8_cast_into(xs: Sequence[torch.Tensor], rows: Sequence[tuple[int, int, int]], amax: torch.Tensor,
                        slots: Sequence[int], outs: Sequence[tuple], *, dtype: torch.dtype, eps: float,
                        pow2: bool) -> None:
    """Cast each ``xs[i]`` (one dtype; ``rows[i] = rows_of(xs[i])``) with the current-scaling
    scale of ``amax[slots[i]]`` (fp32) into ``outs[i] = (row, col, row_scale_inv,
    col_scale_inv)``: contiguous ``dtype`` data ``[M, K]`` / ``[K, M]`` (None: no such
    direction) and their fp32 ``scale_inv``. Every entry has the same directions present."""
    if not xs:
        return
    row, col = outs[0][0] is not None, outs[0][1] is not None
    # fp8.tensor's note on fp32 inputs: with both directions, cast rowwise, then transpose the
    # rowwise codes (a quarter of the fp32 bytes) into the columnwise buffers
    col_from_row = xs[0].dtype == torch.float32 and row and col
    col_in_cast = col and not col_from_row
    bm, bk, warps = _CAST_TILE[col_in_cast]
    ints, cast_starts, t_starts, aligned = [], [0], [0], True
    for x, (m, k, s), j, (r, c, r_si, c_si) in zip(xs, rows, slots, outs):
        ptrs = (x.data_ptr(), 0 if r is None else r.data_ptr(), 0 if c is None else c.data_ptr())
        ints += (ptrs[0], m, k, s, j, ptrs[1], ptrs[2], 0 if r is None else r_si.data_ptr(),
                 0 if c is None else c_si.data_ptr())
        cast_starts.append(cast_starts[-1] + max(cdiv(m, bm) * cdiv(k, bk), 1))  # tile 0 writes scale_inv
        t_starts.append(t_starts[-1] + (cdiv(m, _T_TILE) * cdiv(k, _T_TILE) if col_from_row else 0))
        aligned = aligned and all(v % 16 == 0 for v in (m, k, s, *ptrs))
    n = len(xs)
    tab = _table(ints + cast_starts + t_starts, amax.device)
    log_n = (n - 1).bit_length()
    launch(_multi_cast_kernel, (cast_starts[-1],), tab, amax, n, X_DTYPE=_TL[xs[0].dtype],
           OUT_DTYPE=_TL[dtype], FMAX=FP8_MAX[dtype], EPS=float(eps), POW2=pow2, ROW=row, COL=col_in_cast,
           COL_SCALE_INV=col, LOG_N=log_n, ALIGNED=aligned, BM=bm, BK=bk, num_warps=warps)
    if col_from_row and t_starts[-1]:
        launch(_multi_transpose_kernel, (t_starts[-1],), tab, n, LOG_N=log_n, ALIGNED=aligned, TILE=_T_TILE,
               num_warps=4)


_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _serves(x: torch.Tensor, device: torch.device) -> bool:
    return x.dtype in _X_DTYPES and x.device == device


def _capturing(device: torch.device) -> bool:
    """A CUDA graph is being captured: no batched launch then (replays would outlive a cached
    table), the callers' per-tensor path runs."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def amaxes_into(xs: Sequence[torch.Tensor], out: torch.Tensor) -> list[int]:
    """``out[i] = max|xs[i]|`` (``out`` fp32 zeros) with one launch per input dtype, for
    every ``xs[i]`` of fp32, bf16 or fp16 that reads as 2D without a copy (``rows_of``);
    returns the other indices."""
    if _capturing(out.device):
        return list(range(len(xs)))
    groups: dict[torch.dtype, tuple[list, list, list]] = {}
    left = []
    for i, x in enumerate(xs):
        r = rows_of(x) if _serves(x, out.device) else None
        if r is None:
            left.append(i)
        else:
            g = groups.setdefault(x.dtype, ([], [], []))
            g[0].append(x), g[1].append(r), g[2].append(i)
    for g_xs, g_rows, g_slots in groups.values():
        multi_amax_into(g_xs, g_rows, out, g_slots)
    return left


def _cast_entry(q, hp: torch.Tensor, dst, device: torch.device) -> tuple | None:
    """``(group key, rows_of(hp), (row, col, row_scale_inv, col_scale_inv))`` when the batched
    cast writes ``dst``'s buffers as ``fp8.tensor.quantize_fp8_tensor_into`` does, else None."""
    rows = rows_of(hp) if hp.dim() >= 2 and _serves(hp, device) else None
    if rows is None:
        return None
    m, k, _ = rows
    out = []
    for st in (dst.rowwise, dst.columnwise):
        if st is None:
            out.append(None)
            continue
        d, si = st.data, st.scale_inv
        if (d.dtype != q.dtype or not d.is_contiguous() or tuple(d.shape) != ((k, m) if st.transposed else (m, k))
                or si.dtype != torch.float32 or si.numel() != 1 or si.device != device or d.device != device):
            return None
        out.append(st)
    row, col = out
    if row is None and col is None:
        return None
    key = (hp.dtype, q.dtype, float(q.amax_epsilon), q.power_of_2_scales, row is not None, col is not None)
    return key, rows, (None if row is None else row.data, None if col is None else col.data,
                       None if row is None else row.scale_inv, None if col is None else col.scale_inv)


def requantize_fp8_many(quantizers, hps, dsts, amax: torch.Tensor | None, slots) -> list[int]:
    """The registry's batched write-back for :class:`Float8Quantizer` (current scaling; a
    delayed quantizer casts as current, ``hybrid.stateless``): groups the pairs
    ``_cast_entry`` accepts by input dtype and quantizer config, and per group one amax
    launch (when ``amax`` is None) and ``multi_fp8_cast_into``. Returns the other indices."""
    device = dsts[0].device if dsts else None
    if device is None or _capturing(device) or (amax is not None and amax.device != device):
        return list(range(len(dsts)))
    if amax is not None:
        amax = amax.float().reshape(-1).contiguous()  # read as fp32 [n] (already so: no copy)
    groups: dict[tuple, list] = {}
    left = []
    for i, (q, hp, dst) in enumerate(zip(quantizers, hps, dsts)):
        e = _cast_entry(q, hp, dst, device)
        if e is None:
            left.append(i)
        else:
            groups.setdefault(e[0], []).append((i, hp, e[1], e[2]))
    if groups and amax is None:
        amax = torch.zeros(len(hps), dtype=torch.float32, device=device)
        slots = range(len(hps))
        for g in groups.values():
            multi_amax_into([x for _, x, _, _ in g], [r for _, _, r, _ in g], amax, [i for i, _, _, _ in g])
    for (_, dtype, eps, pow2, _, _), g in groups.items():
        multi_fp8_cast_into([x for _, x, _, _ in g], [r for _, _, r, _ in g], amax, [slots[i] for i, _, _, _ in g],
                            [o for _, _, _, o in g], dtype=dtype, eps=eps, pow2=pow2)
    return left
