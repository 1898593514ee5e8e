"""NVFP4 fused quantize: amax pass (with the Hadamard-domain amax), then one pass that
reads each ``[BM, BK]`` tile once and writes every requested direction.

Layouts (``formats.nvfp4``): rowwise ``data [M, K/2]`` uint8 + ``block_scale [M/br, K/16]``
E4M3; columnwise ``data [K, M/2]`` + ``block_scale [K/br, M/16]``; ``br`` = 16 for 2D blocks.

* Columnwise blocks are computed in x's orientation (16 along M) and only the packed
  bytes and scales are transposed (as 32-bit values) for the ``[K, M/2]`` store.
* Columnwise with ``rht``: the tile is multiplied by ``blockdiag(T, ..., T)`` ``[BM, BM]``
  with one ``tl.dot`` (bf16 operands for bf16 input — exact products, fp32 accumulation on
  the tensor cores; IEEE fp32 otherwise). Same products as the reference, different
  summation order, so a code may differ from the reference where a value sits within an
  fp32 ulp of a rounding boundary (tested with a mismatch bound).
* Stochastic rounding draws uniforms from Philox (``tl.rand``) seeded by one int64
  drawn from the state's generator per call, offset by the element's index: reproducible
  for a seeded state and unbiased, but not the reference's ``torch.rand`` stream.
* 2D blocks without RHT: columnwise is the exact transpose of rowwise (codes and scales).
Everything else (scales, RNE codes, packing) is bitwise the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_dist.formats import _traced_rng
from hybrid_dist.formats._numerics import hadamard16
from hybrid_dist.formats.nvfp4 import NV_BLOCK, NVFP4Quantizer, NVFP4State, NVFP4Storage, nvfp4_global_scale
from hybrid_dist.kernels._jit_common import cdiv, eager_or_op, cast_fp8, div_rn, e2m1_rne, e2m1_stochastic, pack_pairs

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
def _block_scale(bamax, gs):
    """E4M3 ``sat(amax_block / 6 / gs)`` and the fp32 encode multiplier ``1/(bs·gs)`` (0 if 0)."""
    bs = cast_fp8(div_rn(div_rn(bamax, tl.zeros_like(bamax) + 6.0), tl.zeros_like(bamax) + gs),
                  448.0, tl.float8e4nv)
    denom = bs.to(tl.float32) * gs
    return bs, tl.where(denom > 0, div_rn(tl.zeros_like(denom) + 1.0, denom), 0.0)


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


def _nvfp4_shapes(m, k, rowwise, columnwise, block_rows):
    br = block_rows
    return [((m, k // 2) if rowwise else (0, 0), torch.uint8),
            ((m // br, k // NV_BLOCK) if rowwise else (0, 0), torch.float8_e4m3fn),
            ((k, m // 2) if columnwise else (0, 0), torch.uint8),
            ((k // br, m // NV_BLOCK) if columnwise else (0, 0), torch.float8_e4m3fn)]


@torch.library.custom_op("hybrid_dist::nvfp4_amax", mutates_args=())
def nvfp4_amax_op(x: torch.Tensor, blockdiag_t: torch.Tensor, rht: bool) -> torch.Tensor:
    """fp32 ``[2]``: ``max|x|`` and (if ``rht``) the max of the column-Hadamard transform (else 0)."""
    m, k = x.shape
    out = torch.zeros(2, dtype=torch.float32, device=x.device)
    if x.numel():
        grid = (cdiv(m, _BM), cdiv(k, _BK))
        _nvfp4_amax_kernel[grid](x, blockdiag_t, out, m, k, x.stride(0), RHT=rht, BM=_BM, BK=_BK,
                                 num_warps=4)
    return out


@nvfp4_amax_op.register_fake
def _(x, blockdiag_t, rht):
    return x.new_empty(2, dtype=torch.float32)


@torch.library.custom_op("hybrid_dist::nvfp4_quantize", mutates_args=())
def nvfp4_quantize_op(
    x: torch.Tensor, blockdiag_t: torch.Tensor, global_scales: torch.Tensor, seed: torch.Tensor,
    rowwise: bool, columnwise: bool, derive_col: bool, rht: bool, sr: bool, block_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(row_data, row_block_scale, col_data, col_block_scale)``; absent ones empty.
    ``global_scales`` fp32 ``[2]`` = (rowwise, columnwise) decode scales; ``seed`` int64 [1]."""
    m, k = x.shape
    outs = [torch.empty(s, dtype=d, device=x.device) for s, d in _nvfp4_shapes(m, k, rowwise, columnwise, block_rows)]
    if x.numel():
        grid = lambda meta: (cdiv(m, _BM), cdiv(k, meta["BK"]))  # noqa: E731
        _nvfp4_kernel[grid](
            x, blockdiag_t, global_scales, seed, *outs, m, k, x.stride(0), ROW=rowwise,
            COL=columnwise, DERIVE_COL=derive_col and columnwise, RHT=rht, SR=sr, BR=block_rows,
            BM=_BM,
        )
    return tuple(outs)


@nvfp4_quantize_op.register_fake
def _(x, blockdiag_t, global_scales, seed, rowwise, columnwise, derive_col, rht, sr, block_rows):
    m, k = x.shape
    return tuple(x.new_empty(s, dtype=d) for s, d in _nvfp4_shapes(m, k, rowwise, columnwise, block_rows))


_BD_CACHE: dict[tuple, torch.Tensor] = {}


def _blockdiag_t(seed: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``blockdiag(T, ..., T)`` ``[BM, BM]`` (bf16 for bf16 inputs: exact, T = ±1/4)."""
    dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    if torch.compiler.is_compiling():  # a traced constant; never stored in the eager cache
        return torch.block_diag(*[hadamard16(seed, device)] * (_BM // 16)).to(dtype).contiguous()
    key = (seed, device, dtype)
    if key not in _BD_CACHE:
        t = hadamard16(seed, device)
        _BD_CACHE[key] = torch.block_diag(*[t] * (_BM // 16)).to(dtype).contiguous()
    return _BD_CACHE[key]


_NO_SEED: dict[torch.device, torch.Tensor] = {}


def _seed_tensor(q: NVFP4Quantizer, state, device, like: torch.Tensor) -> torch.Tensor:
    if not q.stochastic_rounding:
        if torch.compiler.is_compiling():
            return torch.zeros(1, dtype=torch.int64, device=device)
        if device not in _NO_SEED:
            _NO_SEED[device] = torch.zeros(1, dtype=torch.int64, device=device)
        return _NO_SEED[device]
    if isinstance(state, NVFP4State):  # the state's generator, traceable (see formats._traced_rng)
        return _traced_rng.state_rand(state, like, (1,), draw=2, kind="randint")
    return torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=device)


def quantize_nvfp4(q: NVFP4Quantizer, x2d, *, rowwise, columnwise, state, amax):
    """Registry impl for :class:`NVFP4Quantizer` (see module doc for the exactness).
    Columnwise from non-bf16 inputs defers to the reference (only bf16 tiles are tested
    with the in-register transposes, see ``fp8_tensor``)."""
    if columnwise and x2d.dtype != torch.bfloat16:
        return NotImplemented
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    dev = x2d.device
    derive_col = q.block_2d and not q.rht
    col_rht = columnwise and not derive_col and q.rht
    t = _blockdiag_t(q.rht_seed, dev, x2d.dtype)
    if amax is None or col_rht:
        amaxes = nvfp4_amax(x2d, t, col_rht)
        amax_row = amaxes[0] if amax is None else amax.float().to(dev).reshape(())
        amax_col = amaxes[1] if col_rht else amax_row
    else:
        amax_row = amax_col = amax.float().to(dev).reshape(())
    gs = nvfp4_global_scale(torch.stack([amax_row, amax_col]))
    row, row_s, col, col_s = nvfp4_quantize(
        x2d, t, gs, _seed_tensor(q, state, dev, x2d), rowwise, columnwise, derive_col, col_rht,
        q.stochastic_rounding, q.block_rows)
    br = q.block_rows
    row_st = col_st = None
    if rowwise:
        row_st = NVFP4Storage(data=row, block_scale=row_s, global_scale=gs[0].clone(), block_rows=br,
                              rht_seed=None, transposed=False)
    if columnwise:
        col_st = NVFP4Storage(data=col, block_scale=col_s, global_scale=(gs[0] if derive_col else gs[1]).clone(),
                              block_rows=br, rht_seed=q.rht_seed if col_rht else None, transposed=True)
    return row_st, col_st


nvfp4_amax = eager_or_op(nvfp4_amax_op, nvfp4_amax_op._init_fn)


nvfp4_quantize = eager_or_op(nvfp4_quantize_op, nvfp4_quantize_op._init_fn)
