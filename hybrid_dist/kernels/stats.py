"""One-pass quantization statistics of a stored direction against its high-precision tensor.

``stats_head(x, storage)`` returns float64 ``[6]``: ``amax``, ``signal_norm``,
``noise_norm``, ``nonzero``, ``underflow``, ``saturated`` — the first six ``FIELDS`` of
``inspection.stats.quant_stats``, with the same definitions — reading ``x`` (the quantizer's
domain ``[R, C]``: any float dtype, any strides, e.g. a transposed view) and the storage's
codes and scales once. Each program reduces a ``[BR, BC]`` tile to six fp32 partials (an
amax, two sums of squares, three counts, each exact up to 2**24); the host sums them in
fp64.

Guarantee: ``x̂`` is the fp32 product ``dequantized_domain`` forms (codes · block scale,
then · per-tensor scale, in that order), and the saturation limit is ``s_b · elem_max`` in
fp32, so ``amax`` and the three counts equal the torch reference bitwise; the norms differ
from it only in summation order (fp32 tree sums per tile). A NaN in ``x`` makes ``amax``
NaN, as ``torch.amax`` does: ``tl.max`` may drop a NaN, so the host takes ``amax`` NaN
where the sum of squares is (a NaN is the only way a sum of squares becomes NaN).

``x=None`` (no high-precision tensor: a quantized parameter) reads the storage only and
takes ``x = x̂``, as the torch code does: ``amax``, ``signal_norm`` and ``nonzero`` of the
dequantized tensor, ``noise_norm`` and ``underflow`` NaN, ``saturated`` NaN (0 for an
identity direction, which has no blocks).

Layouts (stored ``[R, C]``): FP8 per-tensor ``data`` + ``scale_inv`` ``[]``; FP8 blocks
``scale_inv [R/br, C/128]``; MXFP8 E8M0 ``scale [R, C/32]``; NVFP4 ``data [R, C/2]`` (two
E2M1 codes per byte, even column in the low nibble), E4M3 ``block_scale [R/br, C/16]`` and
fp32 ``global_scale``; identity ``data [R, C]``. Scales are read per element through their
strides (cached: they are 16-128× smaller than the data).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from hybrid_dist.formats.float8 import Float8Storage
from hybrid_dist.formats.float8_block import BLOCK as FP8_BLOCK, Float8BlockStorage
from hybrid_dist.formats.identity import IdentityStorage
from hybrid_dist.formats.mxfp8 import MX_BLOCK, MXFP8Storage
from hybrid_dist.formats.numerics import E2M1_MAX, FP8_MAX
from hybrid_dist.formats.nvfp4 import NV_BLOCK, NVFP4Storage
from hybrid_dist.kernels._jit_common import cdiv, e2m1_decode, exp2_int
from hybrid_dist.kernels._launch import launch

__all__ = ["scale_histogram", "stats_head", "supported"]

_IDENTITY, _FP8, _FP8_BLOCK, _MXFP8, _NVFP4 = range(5)
_BR, _BC = 32, 128
_WIDTH = 6


@triton.jit
def _stats_kernel(x_ptr, sx0, sx1, d_ptr, sd0, sd1, s_ptr, ss0, ss1, g_ptr, out_ptr, R, C,
                  FMT: tl.constexpr, HAS_REF: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr,
                  ELEM_MAX: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rr = (pid_r * BR + tl.arange(0, BR))[:, None].to(tl.int64)
    cc = (pid_c * BC + tl.arange(0, BC))[None, :].to(tl.int64)
    mask = (rr < R) & (cc < C)
    if FMT == 4:  # NVFP4: the code's nibble of its byte
        byte = tl.load(d_ptr + rr * sd0 + (cc // 2) * sd1, mask=mask, other=0).to(tl.int32)
        q = e2m1_decode((byte >> ((cc & 1) * 4).to(tl.int32)) & 0xF)
    else:
        q = tl.load(d_ptr + rr * sd0 + cc * sd1, mask=mask, other=0.0).to(tl.float32)
    if FMT == 0:
        xh = q
        s_b = tl.zeros_like(q)
    elif FMT == 1:
        s_b = tl.load(g_ptr) + tl.zeros_like(q)
        xh = q * s_b
    else:
        sp = s_ptr + (rr // SCALE_ROWS) * ss0 + (cc // SCALE_COLS) * ss1
        if FMT == 3:
            s_b = exp2_int(tl.load(sp, mask=mask, other=127).to(tl.int32) - 127)
            xh = q * s_b
        elif FMT == 2:
            s_b = tl.load(sp, mask=mask, other=0.0).to(tl.float32)
            xh = q * s_b
        else:
            g = tl.load(g_ptr)
            bs = tl.load(sp, mask=mask, other=0.0).to(tl.float32)
            xh = (q * bs) * g
            s_b = bs * g
    if HAS_REF:
        x = tl.load(x_ptr + rr * sx0 + cc * sx1, mask=mask, other=0.0).to(tl.float32)
    else:
        x = xh
    ax = tl.abs(x)
    nz = x != 0.0
    base = out_ptr + (pid_r * tl.num_programs(1) + pid_c) * 6
    tl.store(base + 0, tl.max(tl.max(ax, axis=1), axis=0))
    tl.store(base + 1, tl.sum(tl.sum(x * x, axis=1), axis=0))
    tl.store(base + 3, tl.sum(tl.sum(tl.where(nz, 1.0, 0.0), axis=1), axis=0))
    if HAS_REF:  # without a reference the host writes NaN for these
        d = x - xh
        if FMT == 0:
            sat = tl.zeros_like(ax)
        else:
            sat = tl.where(ax > s_b * ELEM_MAX, 1.0, 0.0)
        tl.store(base + 2, tl.sum(tl.sum(d * d, axis=1), axis=0))
        tl.store(base + 4, tl.sum(tl.sum(tl.where(nz & (xh == 0.0), 1.0, 0.0), axis=1), axis=0))
        tl.store(base + 5, tl.sum(tl.sum(sat, axis=1), axis=0))


@triton.jit
def _hist_kernel(s_ptr, n, hist_ptr, LO: tl.constexpr, BINS: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    s = tl.load(s_ptr + offs, mask=offs < n, other=0.0)
    e = ((s.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2 s) of a normal s > 0
    idx = tl.where(s > 0.0, tl.minimum(tl.maximum(e - LO, 0), BINS - 1), 0)
    h = tl.histogram(idx, BINS)
    masked = BLOCK - tl.minimum(n - start, BLOCK)  # lanes past n counted in bin 0: take them out
    h = h - tl.where(tl.arange(0, BINS) == 0, masked, 0)
    tl.atomic_add(hist_ptr + tl.arange(0, BINS), h)


def scale_histogram(s_b: torch.Tensor, lo: int, bins: int) -> torch.Tensor:
    """int64 ``[bins]``: ``#{s in s_b : floor(log2 s) = lo + i}``, the ends clamped, zero,
    negative and NaN scales in bin 0, subnormal ones in the lowest bins' clamp (one read of
    ``s_b``; ``inspection.stats`` with ``lo = -64``, ``bins = 128``)."""
    s = s_b.float().reshape(-1).contiguous()
    hist = torch.zeros(bins, dtype=torch.int32, device=s.device)
    if s.numel():
        block = 4096
        launch(_hist_kernel, (cdiv(s.numel(), block),), s, s.numel(), hist, LO=lo, BINS=bins, BLOCK=block,
               num_warps=4)
    return hist.long()


def _format_args(st):
    """(FMT, data, scale or None, per-tensor scale or None, scale rows, scale cols, elem max)."""
    if isinstance(st, IdentityStorage):
        return _IDENTITY, st.data, None, None, 1, 1, 0.0
    if isinstance(st, Float8Storage):
        return _FP8, st.data, None, st.scale_inv.reshape(()).float(), 1, 1, FP8_MAX[st.data.dtype]
    if isinstance(st, Float8BlockStorage):
        return _FP8_BLOCK, st.data, st.scale_inv, None, st.block_rows, FP8_BLOCK, FP8_MAX[st.data.dtype]
    if isinstance(st, MXFP8Storage):
        return _MXFP8, st.data, st.scale, None, 1, MX_BLOCK, FP8_MAX[st.data.dtype]
    if isinstance(st, NVFP4Storage):
        return _NVFP4, st.data, st.block_scale, st.global_scale.reshape(()).float(), st.block_rows, NV_BLOCK, E2M1_MAX
    return None


def supported(storage) -> bool:
    """Whether ``stats_head`` covers ``storage``'s format."""
    return _format_args(storage) is not None


def stats_head(x: torch.Tensor | None, storage) -> torch.Tensor:
    """float64 ``[6]`` (module doc) of ``storage`` stored ``[R, C]`` against ``x [R, C]``
    (None: no reference)."""
    fmt, data, scale, ts, srows, scols, emax = _format_args(storage)
    r, c = storage.shape2d
    if x is not None and tuple(x.shape) != (r, c):
        raise ValueError(f"stats_head: x has shape {tuple(x.shape)}, the storage is stored [{r}, {c}]; pass x "
                         "in the stored orientation (x2d.t() for a columnwise storage)")
    grid = (cdiv(r, _BR), cdiv(c, _BC))
    partial = torch.empty(grid[0] * grid[1], _WIDTH, dtype=torch.float32, device=data.device)
    if partial.numel():
        s = scale if scale is not None else partial
        xa = x if x is not None else data  # not read without a reference
        launch(_stats_kernel, grid, xa, xa.stride(0), xa.stride(1), data, data.stride(0), data.stride(1),
               s, s.stride(0), s.stride(1) if s.dim() > 1 else 0, ts if ts is not None else partial, partial, r, c,
               FMT=fmt, HAS_REF=x is not None, SCALE_ROWS=srows, SCALE_COLS=scols, ELEM_MAX=float(emax),
               BR=_BR, BC=_BC, num_warps=4)
    p = partial.double()
    head = p.sum(0)
    head[0] = p[:, 0].amax() if p.shape[0] else 0.0
    head[0] = torch.where(head[1].isnan(), head[1], head[0])  # sum x² is NaN iff some x is
    head[1:3] = head[1:3].sqrt()
    if x is None:  # what needs the reference; an identity direction has no blocks to saturate
        head[2] = head[4] = math.nan
        head[5] = 0.0 if fmt == _IDENTITY else math.nan
    return head
