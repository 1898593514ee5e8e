"""The previous NVFP4 quantize kernels (64-row tiles, RHT as a ``[64, 64]`` block-diagonal
``tl.dot``, 8-bit in-register transposes), kept verbatim as the baseline of
``benchmarks/quantize.py --sweep``. Its stochastic rounding draws a 32-bit uniform per
element (one Philox call per 4 elements), not the current kernels' 8 bits per element, so
its SR outputs differ from theirs. Not registered; not used by the library.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_dist.formats.numerics import hadamard16
from hybrid_dist.kernels._jit_common import cdiv, e2m1_rne, e2m1_stochastic, pack_pairs
from hybrid_dist.kernels._jit_common import nvfp4_block_scale as _block_scale

_BM, _BK = 64, 64

@triton.jit
def _rht_cols(x, bd_ptr, BM: tl.constexpr):
    """``x [BM, BK]`` with each 16-chunk along M multiplied by ``T``: ``blockdiag(T) @ x``.

    bf16 input: bf16 operands (exact: x is bf16, T = ±1/4) with fp32 accumulation on the
    tensor cores; fp32 input: an IEEE fp32 dot."""
    r = tl.arange(0, BM)
    bd = tl.load(bd_ptr + r[:, None] * BM + r[None, :])
    if bd_ptr.dtype.element_ty == tl.bfloat16:
        y = tl.dot(bd, x.to(tl.bfloat16), out_dtype=tl.float32)
    else:
        y = tl.dot(bd, x, input_precision="ieee")
    return y


@triton.jit
def _nvfp4_amax_kernel(x_ptr, bd_ptr, amax_ptr, M, K, stride_m, RHT: tl.constexpr,
                       BM: tl.constexpr, BK: tl.constexpr):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)[:, None]
    rk = pid_k * BK + tl.arange(0, BK)[None, :]
    x = tl.load(x_ptr + rm * stride_m + rk, mask=(rm < M) & (rk < K), other=0.0).to(tl.float32)
    tl.atomic_max(amax_ptr, sem="relaxed", val=tl.max(tl.max(tl.abs(x), axis=1), axis=0))
    if RHT:
        y = _rht_cols(x, bd_ptr, BM)
        tl.atomic_max(amax_ptr + 1, sem="relaxed", val=tl.max(tl.max(tl.abs(y), axis=1), axis=0))


@triton.jit
def _codes(scaled, seed, offs_q, R: tl.constexpr, C: tl.constexpr, SR: tl.constexpr):
    """E2M1 codes; SR draws 4 uniforms per Philox call at offsets ``offs_q [R, C/4]``."""
    scaled = tl.minimum(tl.maximum(scaled, -6.0), 6.0)
    if SR:
        u0, u1, u2, u3 = tl.rand4x(seed, offs_q)
        rand = tl.reshape(tl.join(tl.join(u0, u1), tl.join(u2, u3)), (R, C))
        codes = e2m1_stochastic(scaled, rand)
    else:
        codes = e2m1_rne(scaled)
    return codes


@triton.jit
def _quantize_rows(v, gs, seed, offs, R: tl.constexpr, C: tl.constexpr, BR: tl.constexpr,
                   SR: tl.constexpr):
    """Blocks of (BR rows × 16 along C): codes int32 ``[R, C]``, scales ``[R/BR, C/16]``."""
    blocks = tl.reshape(v, (R // BR, BR, C // 16, 16))
    bs, enc = _block_scale(tl.max(tl.max(tl.abs(blocks), axis=3), axis=1), gs)
    return _codes(tl.reshape(blocks * enc[:, None, :, None], (R, C)), seed, offs, R, C, SR), bs


@triton.jit
def _quantize_cols(v, gs, seed, offs, R: tl.constexpr, C: tl.constexpr, BC: tl.constexpr,
                   SR: tl.constexpr):
    """Blocks of (16 along R × BC cols): codes int32 ``[R, C]``, scales ``[R/16, C/BC]``."""
    blocks = tl.reshape(v, (R // 16, 16, C // BC, BC))
    bs, enc = _block_scale(tl.max(tl.max(tl.abs(blocks), axis=3), axis=1), gs)
    return _codes(tl.reshape(blocks * enc[:, None, :, None], (R, C)), seed, offs, R, C, SR), bs


@triton.jit
def _store_cols(codes, bs, col_ptr, col_s_ptr, pid_m, pid_k, M, K, BR: tl.constexpr,
                BM: tl.constexpr, BK: tl.constexpr):
    """Store x-oriented codes ``[BM, BK]`` (blocks along M) as columnwise ``[K, M/2]``
    packed bytes and their scales ``[BM/16, BK/BR]`` as ``[K/BR, M/16]`` (32-bit transposes)."""
    lo, hi = tl.split(tl.permute(tl.reshape(codes, (BM // 2, 2, BK)), (0, 2, 1)))
    packed_t = tl.trans(lo | (hi << 4)).to(tl.uint8)  # [BK, BM/2]
    ck = pid_k * BK + tl.arange(0, BK)[:, None]
    pm = pid_m * (BM // 2) + tl.arange(0, BM // 2)[None, :]
    tl.store(col_ptr + ck * (M // 2) + pm, packed_t, mask=(ck < K) & (pm < M // 2))
    sk = pid_k * (BK // BR) + tl.arange(0, BK // BR)[:, None]
    sm = pid_m * (BM // 16) + tl.arange(0, BM // 16)[None, :]
    bs_t = tl.trans(bs.to(tl.float32)).to(tl.float8e4nv)
    tl.store(col_s_ptr + sk * (M // 16) + sm, bs_t, mask=(sk < K // BR) & (sm < M // 16))


# BM is fixed at 64: the Hadamard block-diagonal matrix is [64, 64]
_CONFIGS = [triton.Config({"BK": bk}, num_warps=w) for bk, w in ((64, 4), (32, 4), (128, 4), (128, 8), (64, 8))]


@triton.autotune(configs=_CONFIGS, key=["M", "K", "ROW", "COL", "RHT", "SR", "BR"])
@triton.jit
def _nvfp4_kernel(
    x_ptr, bd_ptr, gs_ptr, seed_ptr, row_ptr, row_s_ptr, col_ptr, col_s_ptr, M, K, stride_m,
    ROW: tl.constexpr, COL: tl.constexpr, DERIVE_COL: tl.constexpr, RHT: tl.constexpr,
    SR: tl.constexpr, BR: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)[:, None]
    rk = pid_k * BK + tl.arange(0, BK)[None, :]
    x = tl.load(x_ptr + rm * stride_m + rk, mask=(rm < M) & (rk < K), other=0.0).to(tl.float32)
    seed = tl.load(seed_ptr) if SR else 0
    # Philox offsets: one per 4 consecutive elements along K (rowwise, then columnwise)
    kq = tl.cdiv(K, 4)
    offs_q = rm * kq + pid_k * (BK // 4) + tl.arange(0, BK // 4)[None, :]
    if ROW or DERIVE_COL:
        codes, bs = _quantize_rows(x, tl.load(gs_ptr), seed, offs_q, BM, BK, BR, SR)
        if ROW:
            pk = pid_k * (BK // 2) + tl.arange(0, BK // 2)[None, :]
            sm = pid_m * (BM // BR) + tl.arange(0, BM // BR)[:, None]
            sk = pid_k * (BK // 16) + tl.arange(0, BK // 16)[None, :]
            tl.store(row_ptr + rm * (K // 2) + pk, pack_pairs(codes, BM, BK), mask=(rm < M) & (pk < K // 2))
            tl.store(row_s_ptr + sm * (K // 16) + sk, bs, mask=(sm < M // BR) & (sk < K // 16))
        if DERIVE_COL:  # 2D blocks: columnwise is the exact transpose (16x16 blocks)
            _store_cols(codes, bs, col_ptr, col_s_ptr, pid_m, pid_k, M, K, BR, BM, BK)
    if COL and not DERIVE_COL:
        if RHT:
            y = _rht_cols(x, bd_ptr, BM)
        else:
            y = x
        codes, bs = _quantize_cols(y, tl.load(gs_ptr + 1), seed, M * kq + offs_q, BM, BK, BR, SR)
        _store_cols(codes, bs, col_ptr, col_s_ptr, pid_m, pid_k, M, K, BR, BM, BK)



def nvfp4_quantize_v1(x, global_scales, seed, rowwise, columnwise, derive_col, rht, sr, block_rows, rht_seed=0):
    """Old amax-free quantize pass: ``(row_data, row_block_scale, col_data, col_block_scale)``
    with the given fp32 ``[2]`` decode scales and int64 ``[1]`` seed; absent ones empty."""
    m, k = x.shape
    br = block_rows
    shapes = [((m, k // 2) if rowwise else (0, 0), torch.uint8),
              ((m // br, k // 16) if rowwise else (0, 0), torch.float8_e4m3fn),
              ((k, m // 2) if columnwise else (0, 0), torch.uint8),
              ((k // br, m // 16) if columnwise else (0, 0), torch.float8_e4m3fn)]
    outs = [torch.empty(s, dtype=d, device=x.device) for s, d in shapes]
    t = torch.block_diag(*[hadamard16(rht_seed, x.device)] * (_BM // 16)).to(torch.bfloat16).contiguous()
    grid = lambda meta: (cdiv(m, _BM), cdiv(k, meta["BK"]))  # noqa: E731
    _nvfp4_kernel[grid](x, t, global_scales, seed, *outs, m, k, x.stride(0), ROW=rowwise, COL=columnwise,
                        DERIVE_COL=derive_col and columnwise, RHT=rht, SR=sr, BR=block_rows, BM=_BM)
    return tuple(outs)


def nvfp4_amax_v1(x, rht, rht_seed=0):
    """Old amax pass (64×64 tiles, one atomic per tile): fp32 ``[2]``."""
    m, k = x.shape
    out = torch.zeros(2, dtype=torch.float32, device=x.device)
    t = torch.block_diag(*[hadamard16(rht_seed, x.device)] * (_BM // 16)).to(torch.bfloat16).contiguous()
    _nvfp4_amax_kernel[(cdiv(m, _BM), cdiv(k, _BK))](x, t, out, m, k, x.stride(0), RHT=rht, BM=_BM, BK=_BK,
                                                    num_warps=4)
    return out
