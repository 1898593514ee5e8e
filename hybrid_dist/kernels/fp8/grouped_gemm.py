"""Grouped FP8 GEMMs for any per-tensor FP8 dtype pair (E4M3/E5M2 mixed), sync-free (Triton).

Legend: E experts (groups), C the packed token capacity, ``offs [E]`` int32 cumulative
group ends on the device (``offs[-1] <= C``; group g spans ``[offs[g-1], offs[g])``),
``sa``, ``sb`` fp32 ``[E]`` per-expert decode scales (``scale_inv``). All FP8 operands are
row-major with the contraction dim last (K-major: what Hopper FP8 wgmma needs for both).

    grouped_rows_fp8    out [C, R]      = (a[s:e] · b[g]ᵀ) · sa[g]·sb[g]     a [C, Kc], b [E, R, Kc]
    grouped_tokens_fp8  out [E, Ra, Rb] = (a[:, s:e] · b[:, s:e]ᵀ) · sa[g]·sb[g]   a [Ra, C], b [Rb, C]

``grouped_rows_fp8`` (fprop, dgrad): persistent, one program per multiprocessor walking the
real row tiles (counted from ``offs`` on the device) times the N tiles, GROUP_M-swizzled;
operands arrive by TMA (``Kc`` a multiple of 16; boxes past ``Kc`` or ``C`` read zeros); only
rows inside a tile's group and columns ``< R`` are stored. Rows ``>= offs[-1]`` are NOT
written (the output is ``torch.empty``); with ``tokens`` the output is in token order.
``grouped_tokens_fp8`` (wgrad): persistent over the E · tiles of Ra × tiles of Rb output
tiles, expert-major; operands by TMA over each group's contraction range (``C`` a multiple
of 16), the columns of a group's last box past its end zeroed; group bounds must be
multiples of 16 (the packed layout guarantees it; unchecked), and an empty group writes
zeros. Output tiles are stored by TMA when ``Rb`` is a multiple of 8.

``grouped_rows`` / ``grouped_tokens`` call the host wrappers in eager code and, while
``torch.compile`` traces, the same wrappers as one ``torch.library`` operator each (an
opaque call in the graph: the same kernels, so the same bytes as eager).

Accumulation in fp32 on the tensor cores; the scale product multiplies the fp32 accumulator,
one rounding to bf16. ``fast_accum=False`` promotes the Hopper FP8 partial sums to fp32
every BK=128 products, ``True`` never (Triton's sm90 default). Mixed dtypes: the sm90 wgmma
lowering types A and B separately (``wgmma ... .e5m2.e4m3``), so no operand is upcast.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from hybrid_dist.kernels._jit_common import eager_or_op
from hybrid_dist.library_op import library_op

__all__ = ["grouped_rows", "grouped_rows_fp8", "grouped_tokens", "grouped_tokens_fp8"]

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _tokens_configs():
    """Autotune configs of the wgrad kernel (``_rows_configs``: the rows kernel's)."""
    if os.environ.get("TRITON_INTERPRET") == "1":  # one small config (tiles split groups): CPU tests
        return [triton.Config({"BM": 64, "BN": 64, "BK": 32, "GROUP_M": 2}, num_warps=4, pre_hook=_set_blocks)]
    # sm90 ptxas: no spills with fast_accum at BN=256; 128x128/8 warps has none when promoting (a
    # second fp32 accumulator); autotuning picks among them per shape
    shapes = ((128, 256, 8, 3), (128, 256, 8, 4), (128, 128, 4, 4), (128, 128, 8, 4), (256, 128, 8, 3),
              (256, 128, 8, 4))
    return [triton.Config({"BM": bm, "BN": bn, "BK": 128, "GROUP_M": 8}, num_warps=w, num_stages=s,
                          pre_hook=_set_blocks) for bm, bn, w, s in shapes]


@triton.jit
def _swizzle(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of a 1D program id, GROUP_M row tiles at a time (L2 reuse of b)."""
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % width) % size_m, (pid % width) // size_m


@triton.jit
def _dot(a, b_t, acc, FAST: tl.constexpr, BK: tl.constexpr):
    if FAST:
        return tl.dot(a, b_t, acc)
    return tl.dot(a, b_t, acc, max_num_imprecise_acc=BK)


@triton.jit
def _find_tile(offs_ptr, E, pid_m, BM: tl.constexpr, BLOCK_E: tl.constexpr):
    """(group, first row, group end) of the pid_m-th row tile; group >= E past the last."""
    ge = tl.arange(0, BLOCK_E)
    ends = tl.load(offs_ptr + ge, mask=ge < E, other=0)
    starts = tl.load(offs_ptr + ge - 1, mask=(ge > 0) & (ge < E), other=0)
    tiles = tl.where(ge < E, (ends - starts + BM - 1) // BM, 0)
    last = tl.cumsum(tiles, 0)  # inclusive: tiles of groups 0..g
    g = tl.sum((last <= pid_m).to(tl.int32), 0)
    sel = ge == g
    row0 = tl.sum(tl.where(sel, starts + (pid_m - last + tiles) * BM, 0), 0)
    return g, row0, tl.sum(tl.where(sel, ends, 0), 0)


def _set_blocks(nargs):
    """Autotune pre-hook: the TMA boxes of the config (host descriptors carry them)."""
    nargs["a_desc"].block_shape = [nargs["BM"], nargs["BK"]]
    nargs["b_desc"].block_shape = [nargs["BN"], nargs["BK"]]
    if nargs.get("out_desc") is not None:
        nargs["out_desc"].block_shape = [1, nargs["BM"], nargs["BN"]]


def _rows_configs():
    if os.environ.get("TRITON_INTERPRET") == "1":
        return [triton.Config({"BM": 64, "BN": 64, "BK": 32, "GROUP_M": 2}, num_warps=4, pre_hook=_set_blocks)]
    # the fastest of each accumulation mode at the MoE benchmark's dgrad shape on sm_90 (256x128/s3
    # promoting, 128x256/s4 with fast_accum), autotuned per shape
    shapes = ((256, 128, 8, 3), (128, 256, 8, 4), (128, 256, 8, 3))
    return [triton.Config({"BM": bm, "BN": bn, "BK": 128, "GROUP_M": 8}, num_warps=w, num_stages=s,
                          pre_hook=_set_blocks) for bm, bn, w, s in shapes]


@triton.jit
def _group_start(offs_ptr, g):
    """First packed row (or column) of group ``g``: ``offs[g-1]``, 0 for the first group."""
    return tl.load(offs_ptr + tl.maximum(g - 1, 0)) * (g > 0)


@triton.autotune(configs=_rows_configs(), key=["R", "Kc", "FAST"])
@triton.jit
def _rows_kernel(a_desc, b_desc, sa_ptr, sb_ptr, offs_ptr, tok_ptr, out_ptr, C, R, Kc, E, FAST: tl.constexpr,
                 TOKENS: tl.constexpr, BLOCK_E: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, GROUP_M: tl.constexpr):
    """Persistent: program p computes tiles p, p + P, ... of the real tiles (count from offs)."""
    ge = tl.arange(0, BLOCK_E)
    sizes = tl.load(offs_ptr + ge, mask=ge < E, other=0) - tl.load(offs_ptr + ge - 1, mask=(ge > 0) & (ge < E),
                                                                    other=0)
    num_m = tl.sum((sizes + BM - 1) // BM, 0)
    num_n = tl.cdiv(R, BN)
    for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0)):
        pid_m, pid_n = _swizzle(tile, num_m, num_n, GROUP_M)
        g, row0, row_end = _find_tile(offs_ptr, E, pid_m, BM, BLOCK_E)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, Kc, BK):  # boxes past Kc (or past C) read zeros; rows past row_end are not stored
            a = a_desc.load([row0, k])
            b = b_desc.load([g * R + pid_n * BN, k])  # rows past R (the next expert's) are not stored
            acc = _dot(a, b.T, acc, FAST, BK)
        rm = row0 + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        out = (acc * (tl.load(sa_ptr + g) * tl.load(sb_ptr + g))).to(tl.bfloat16)
        if TOKENS:  # packed row p of group g is token p - start_g + tok_start_g; padding rows skipped
            first, tok_first = _group_start(offs_ptr, g), _group_start(tok_ptr, g)
            row_end = tl.minimum(row_end, first + tl.load(tok_ptr + g) - tok_first)
            out_rows = rm - first + tok_first
        else:
            out_rows = rm
        out_ptrs = out_ptr + out_rows[:, None].to(tl.int64) * R + rn[None, :]
        tl.store(out_ptrs, out, mask=(rm[:, None] < row_end) & (rn[None, :] < R))


@triton.autotune(configs=_tokens_configs(), key=["Ra", "Rb", "FAST"])
@triton.jit
def _tokens_kernel(a_desc, b_desc, out_desc, sa_ptr, sb_ptr, offs_ptr, out_ptr, Ra, Rb, E, FAST: tl.constexpr,
                   TMA_OUT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   GROUP_M: tl.constexpr):
    """Persistent: program p computes tiles p, p + P, ... of the E · (Ra/BM) · (Rb/BN) output
    tiles, expert-major (a group's operands stay in L2 while its tiles run). A group's whole
    BK boxes come by TMA; its last partial box (group ends are multiples of 16, not of BK)
    is read by TMA too and its columns past the group's end zeroed before the product.
    ``TMA_OUT``: the tile is stored by TMA (``out`` as ``[E, Ra, Rb]``, boxes clipped at each
    expert's edges), asynchronously, so the store overlaps the next tile's loads."""
    num_m, num_n = tl.cdiv(Ra, BM), tl.cdiv(Rb, BN)
    per_group = num_m * num_n
    for tile in tl.range(tl.program_id(0), E * per_group, tl.num_programs(0)):
        g = tile // per_group
        pid_m, pid_n = _swizzle(tile % per_group, num_m, num_n, GROUP_M)
        start = _group_start(offs_ptr, g)
        end = tl.load(offs_ptr + g)
        whole = start + (end - start) // BK * BK
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(start, whole, BK):
            a = a_desc.load([pid_m * BM, k])
            b = b_desc.load([pid_n * BN, k])
            acc = _dot(a, b.T, acc, FAST, BK)
        if whole < end:  # the partial box: columns >= end belong to the next group (or are past C)
            inside = (whole + tl.arange(0, BK))[None, :] < end
            a = a_desc.load([pid_m * BM, whole])
            b = b_desc.load([pid_n * BN, whole])
            a, b = tl.where(inside, a, tl.zeros_like(a)), tl.where(inside, b, tl.zeros_like(b))
            acc = _dot(a, b.T, acc, FAST, BK)
        scale = tl.load(sa_ptr + g) * tl.load(sb_ptr + g)
        out = tl.where(end > start, acc * scale, 0.0).to(tl.bfloat16)  # empty group: 0 for any scale
        if TMA_OUT:
            out_desc.store([g, pid_m * BM, pid_n * BN], tl.reshape(out, [1, BM, BN]))
        else:
            rm = pid_m * BM + tl.arange(0, BM)
            rn = pid_n * BN + tl.arange(0, BN)
            out_ptrs = out_ptr + (g.to(tl.int64) * Ra + rm[:, None]) * Rb + rn[None, :]
            tl.store(out_ptrs, out, mask=(rm[:, None] < Ra) & (rn[None, :] < Rb))


def _num_programs(device) -> int:
    """Persistent grid size: the multiprocessor count (3 under the interpreter: several
    tiles per program there too)."""
    if device.type != "cuda":
        return 3
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check(a, b, scale_a, scale_b, offs, e):
    if a.dtype not in _FP8 or b.dtype not in _FP8 or offs.dtype != torch.int32 or offs.shape != (e,):
        raise ValueError(f"grouped FP8 GEMM: a {a.dtype}, b {b.dtype} must be float8_e4m3fn/e5m2 and offs int32 "
                         f"[{e}]; got offs {offs.dtype} {tuple(offs.shape)}")
    if scale_a.numel() != e or scale_b.numel() != e:
        raise ValueError(f"grouped FP8 GEMM: per-expert scales [{e}] expected, got {scale_a.shape}, {scale_b.shape}")
    return scale_a.float().contiguous(), scale_b.float().contiguous()


def grouped_rows_fp8(a, b, scale_a, scale_b, offs, *, fast_accum: bool = False,
                     tokens: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """bf16 ``[C, R]`` (module doc): ``a [C, Kc]``, ``b [E, R, Kc]`` FP8; rows >= offs[-1] unwritten.

    ``tokens = (tok_offs, T)``: group g's first ``tok_offs[g] - tok_offs[g-1]`` rows are real
    tokens (int32 ``[E]`` cumulative counts; the rest of the group is padding): the output is
    ``[T, R]`` in token order instead (what ``out_pad.index_select(0, dest)`` would give, with
    no padded buffer and no gather)."""
    (c, kc), (e, r) = a.shape, b.shape[:2]
    if b.dim() != 3 or b.shape[2] != kc:
        raise ValueError(f"grouped_rows_fp8: a [C, Kc] and b [E, R, Kc]; got {tuple(a.shape)}, {tuple(b.shape)}")
    sa, sb = _check(a, b, scale_a, scale_b, offs, e)
    tok_offs = offs if tokens is None else tokens[0]
    if tok_offs.dtype != torch.int32 or tok_offs.shape != (e,):
        raise ValueError(f"grouped_rows_fp8: tokens offsets int32 [{e}] expected, got {tok_offs.dtype} "
                         f"{tuple(tok_offs.shape)}")
    if kc % 16:
        raise ValueError(f"grouped_rows_fp8: Kc={kc} must be a multiple of 16 (TMA rows of 16-byte multiples)")
    out = torch.empty((c if tokens is None else tokens[1], r), dtype=torch.bfloat16, device=a.device)
    if out.numel() == 0 or e == 0:
        return out
    # boxes are set per config by the autotune pre-hook (_set_blocks)
    a_desc = TensorDescriptor.from_tensor(a.contiguous(), [1, 16])
    b_desc = TensorDescriptor.from_tensor(b.contiguous().view(e * r, kc), [1, 16])
    programs = _num_programs(a.device)

    def grid(meta):
        return (min(programs, (triton.cdiv(c, meta["BM"]) + e) * triton.cdiv(r, meta["BN"])),)
    _rows_kernel[grid](a_desc, b_desc, sa, sb, offs, tok_offs, out, c, r, kc, e, FAST=fast_accum,
                       TOKENS=tokens is not None, BLOCK_E=triton.next_power_of_2(max(e, 2)))
    return out


def grouped_tokens_fp8(a, b, scale_a, scale_b, offs, *, fast_accum: bool = False) -> torch.Tensor:
    """bf16 ``[E, Ra, Rb]`` (module doc): ``a [Ra, C]``, ``b [Rb, C]`` FP8, ``C`` and the
    groups along it (starts) multiples of 16; empty groups zero."""
    (ra, c), (rb, cb), e = a.shape, b.shape, offs.numel()
    if cb != c:
        raise ValueError(f"grouped_tokens_fp8: a [Ra, C] and b [Rb, C]; got {tuple(a.shape)}, {tuple(b.shape)}")
    sa, sb = _check(a, b, scale_a, scale_b, offs, e)
    out = torch.empty((e, ra, rb), dtype=torch.bfloat16, device=a.device)
    if out.numel() == 0:
        return out
    if c % 16:
        raise ValueError(f"grouped_tokens_fp8: C={c} must be a multiple of 16 (TMA rows of 16-byte multiples)")
    # boxes are set per config by the autotune pre-hook (_set_blocks)
    a_desc = TensorDescriptor.from_tensor(a.contiguous(), [1, 16])
    b_desc = TensorDescriptor.from_tensor(b.contiguous(), [1, 16])
    tma_out = rb % 8 == 0  # TMA rows of 16-byte multiples
    out_desc = TensorDescriptor.from_tensor(out, [1, 1, 8]) if tma_out else None
    programs = _num_programs(a.device)

    def grid(meta):
        return (min(programs, e * triton.cdiv(ra, meta["BM"]) * triton.cdiv(rb, meta["BN"])),)
    _tokens_kernel[grid](a_desc, b_desc, out_desc, sa, sb, offs, out, ra, rb, e, FAST=fast_accum, TMA_OUT=tma_out)
    return out


@library_op("hybrid_dist::grouped_rows_fp8")
def rows_op(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, offs: torch.Tensor,
            fast_accum: bool, tok_offs: torch.Tensor | None, tokens: int) -> torch.Tensor:
    """``grouped_rows_fp8`` as an operator (``tokens`` is read only with ``tok_offs``)."""
    return grouped_rows_fp8(a, b, scale_a, scale_b, offs, fast_accum=fast_accum,
                            tokens=None if tok_offs is None else (tok_offs, tokens))


@rows_op.register_fake
def _(a, b, scale_a, scale_b, offs, fast_accum, tok_offs, tokens):
    return a.new_empty((a.shape[0] if tok_offs is None else tokens, b.shape[1]), dtype=torch.bfloat16)


@library_op("hybrid_dist::grouped_tokens_fp8")
def tokens_op(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, offs: torch.Tensor,
              fast_accum: bool) -> torch.Tensor:
    """``grouped_tokens_fp8`` as an operator."""
    return grouped_tokens_fp8(a, b, scale_a, scale_b, offs, fast_accum=fast_accum)


@tokens_op.register_fake
def _(a, b, scale_a, scale_b, offs, fast_accum):
    return a.new_empty((offs.shape[0], a.shape[0], b.shape[0]), dtype=torch.bfloat16)


# eager: the host wrappers without the dispatcher; while compiling: the operators
grouped_rows = eager_or_op(rows_op, rows_op.fn)
grouped_tokens = eager_or_op(tokens_op, tokens_op.fn)
