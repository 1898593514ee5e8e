"""NVFP4 fused quantize: amax pass (with the Hadamard-domain amax), then one pass that
reads each ``[BM, BK]`` tile once and writes every requested direction.

Layouts (``formats.nvfp4``): rowwise ``data [M, K/2]`` uint8 + ``block_scale [M/br, K/16]``
E4M3; columnwise ``data [K, M/2]`` + ``block_scale [K/br, M/16]``; ``br`` = 16 for 2D blocks.

* Columnwise with ``rht``: the transposed tile ``[BK, BM]`` is cut into 16-chunks along M
  and multiplied by ``Tᵀ`` with a 16×16 ``tl.dot`` in IEEE fp32 — same products as the
  reference, different summation order, so codes may differ from the reference where a
  value sits within an fp32 ulp of a rounding boundary (tested with a mismatch bound).
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

from hybrid_dist.formats._numerics import hadamard16
from hybrid_dist.formats.nvfp4 import NV_BLOCK, NVFP4Quantizer, NVFP4State, NVFP4Storage, nvfp4_global_scale
from hybrid_dist.kernels._jit_common import cast_fp8, div_rn, e2m1_rne, e2m1_stochastic, pack_pairs

_BM, _BK = 64, 64


@triton.jit
def _rht_t(x, t_ptr, BM: tl.constexpr, BK: tl.constexpr):
    """Transposed tile ``[BK, BM]`` with each 16-chunk along M multiplied by ``Tᵀ``."""
    r16 = tl.arange(0, 16)
    tt = tl.load(t_ptr + r16[:, None] * 16 + r16[None, :])  # Tᵀ, row-major
    chunks = tl.reshape(tl.trans(x), (BK * BM // 16, 16))
    return tl.reshape(tl.dot(chunks, tt, input_precision="ieee"), (BK, BM))


@triton.jit
def _nvfp4_amax_kernel(x_ptr, t_ptr, amax_ptr, M, K, stride_m, RHT: tl.constexpr,
                       BM: tl.constexpr, BK: tl.constexpr):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)[:, None]
    rk = pid_k * BK + tl.arange(0, BK)[None, :]
    x = tl.load(x_ptr + rm * stride_m + rk, mask=(rm < M) & (rk < K), other=0.0).to(tl.float32)
    tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(x), axis=1), axis=0))
    if RHT:
        y = _rht_t(x, t_ptr, BM, BK)
        tl.atomic_max(amax_ptr + 1, tl.max(tl.max(tl.abs(y), axis=1), axis=0))


@triton.jit
def _quantize_tile(v, gs, seed, offs, R: tl.constexpr, C: tl.constexpr, BR: tl.constexpr,
                   SR: tl.constexpr):
    """Codes (int32 ``[R, C]``) and E4M3 block scales ``[R/BR, C/16]`` of fp32 ``v``."""
    blocks = tl.reshape(v, (R // BR, BR, C // 16, 16))
    bamax = tl.max(tl.max(tl.abs(blocks), axis=3), axis=1)
    bs = cast_fp8(div_rn(div_rn(bamax, tl.zeros_like(bamax) + 6.0), tl.zeros_like(bamax) + gs),
                  448.0, tl.float8e4nv)
    denom = bs.to(tl.float32) * gs
    enc = tl.where(denom > 0, div_rn(tl.zeros_like(denom) + 1.0, denom), 0.0)
    scaled = tl.reshape(blocks * enc[:, None, :, None], (R, C))
    scaled = tl.minimum(tl.maximum(scaled, -6.0), 6.0)
    if SR:
        codes = e2m1_stochastic(scaled, tl.rand(seed, offs))
    else:
        codes = e2m1_rne(scaled)
    return codes, bs


@triton.jit
def _nvfp4_kernel(
    x_ptr, t_ptr, gs_ptr, seed_ptr, row_ptr, row_s_ptr, col_ptr, col_s_ptr, M, K, stride_m,
    ROW: tl.constexpr, COL: tl.constexpr, DERIVE_COL: tl.constexpr, RHT: tl.constexpr,
    SR: tl.constexpr, BR: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)[:, None]
    rk = pid_k * BK + tl.arange(0, BK)[None, :]
    x = tl.load(x_ptr + rm * stride_m + rk, mask=(rm < M) & (rk < K), other=0.0).to(tl.float32)
    seed = tl.load(seed_ptr) if SR else 0
    ck = pid_k * BK + tl.arange(0, BK)[:, None]
    cm = pid_m * BM + tl.arange(0, BM)[None, :]
    if ROW or DERIVE_COL:
        codes, bs = _quantize_tile(x, tl.load(gs_ptr), seed, rm * K + rk, BM, BK, BR, SR)
        pk = pid_k * (BK // 2) + tl.arange(0, BK // 2)[None, :]
        sm = pid_m * (BM // BR) + tl.arange(0, BM // BR)[:, None]
        sk = pid_k * (BK // 16) + tl.arange(0, BK // 16)[None, :]
        if ROW:
            tl.store(row_ptr + rm * (K // 2) + pk, pack_pairs(codes, BM, BK), mask=(rm < M) & (pk < K // 2))
            tl.store(row_s_ptr + sm * (K // 16) + sk, bs, mask=(sm < M // BR) & (sk < K // 16))
        if DERIVE_COL:
            pm = pid_m * (BM // 2) + tl.arange(0, BM // 2)[None, :]
            tl.store(col_ptr + ck * (M // 2) + pm, pack_pairs(tl.trans(codes), BK, BM),
                     mask=(ck < K) & (pm < M // 2))
            tsk = pid_k * (BK // 16) + tl.arange(0, BK // 16)[:, None]
            tsm = pid_m * (BM // 16) + tl.arange(0, BM // 16)[None, :]
            tl.store(col_s_ptr + tsk * (M // 16) + tsm, tl.trans(bs), mask=(tsk < K // 16) & (tsm < M // 16))
    if COL and not DERIVE_COL:
        if RHT:
            y = _rht_t(x, t_ptr, BM, BK)
        else:
            y = tl.trans(x)
        codes, bs = _quantize_tile(y, tl.load(gs_ptr + 1), seed, M * K + ck * M + cm, BK, BM, BR, SR)
        pm = pid_m * (BM // 2) + tl.arange(0, BM // 2)[None, :]
        tl.store(col_ptr + ck * (M // 2) + pm, pack_pairs(codes, BK, BM), mask=(ck < K) & (pm < M // 2))
        sk = pid_k * (BK // BR) + tl.arange(0, BK // BR)[:, None]
        sm = pid_m * (BM // 16) + tl.arange(0, BM // 16)[None, :]
        tl.store(col_s_ptr + sk * (M // 16) + sm, bs, mask=(sk < K // BR) & (sm < M // 16))


def _nvfp4_shapes(m, k, rowwise, columnwise, block_rows):
    br = block_rows
    return [((m, k // 2) if rowwise else (0, 0), torch.uint8),
            ((m // br, k // NV_BLOCK) if rowwise else (0, 0), torch.float8_e4m3fn),
            ((k, m // 2) if columnwise else (0, 0), torch.uint8),
            ((k // br, m // NV_BLOCK) if columnwise else (0, 0), torch.float8_e4m3fn)]


@torch.library.custom_op("hybrid_dist::nvfp4_amax", mutates_args=())
def nvfp4_amax(x: torch.Tensor, t_transposed: torch.Tensor, rht: bool) -> torch.Tensor:
    """fp32 ``[2]``: ``max|x|`` and (if ``rht``) ``max|RHT(xᵀ)|`` (else 0)."""
    m, k = x.shape
    out = torch.zeros(2, dtype=torch.float32, device=x.device)
    if x.numel():
        grid = (triton.cdiv(m, _BM), triton.cdiv(k, _BK))
        _nvfp4_amax_kernel[grid](x, t_transposed, out, m, k, x.stride(0), RHT=rht, BM=_BM, BK=_BK,
                                 num_warps=4)
    return out


@nvfp4_amax.register_fake
def _(x, t_transposed, rht):
    return x.new_empty(2, dtype=torch.float32)


@torch.library.custom_op("hybrid_dist::nvfp4_quantize", mutates_args=())
def nvfp4_quantize(
    x: torch.Tensor, t_transposed: torch.Tensor, global_scales: torch.Tensor, seed: torch.Tensor,
    rowwise: bool, columnwise: bool, derive_col: bool, rht: bool, sr: bool, block_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(row_data, row_block_scale, col_data, col_block_scale)``; absent ones empty.
    ``global_scales`` fp32 ``[2]`` = (rowwise, columnwise) decode scales; ``seed`` int64 [1]."""
    m, k = x.shape
    outs = [torch.empty(s, dtype=d, device=x.device) for s, d in _nvfp4_shapes(m, k, rowwise, columnwise, block_rows)]
    if x.numel():
        grid = (triton.cdiv(m, _BM), triton.cdiv(k, _BK))
        _nvfp4_kernel[grid](
            x, t_transposed, global_scales, seed, *outs, m, k, x.stride(0), ROW=rowwise,
            COL=columnwise, DERIVE_COL=derive_col and columnwise, RHT=rht, SR=sr, BR=block_rows,
            BM=_BM, BK=_BK, num_warps=4,
        )
    return tuple(outs)


@nvfp4_quantize.register_fake
def _(x, t_transposed, global_scales, seed, rowwise, columnwise, derive_col, rht, sr, block_rows):
    m, k = x.shape
    return tuple(x.new_empty(s, dtype=d) for s, d in _nvfp4_shapes(m, k, rowwise, columnwise, block_rows))


_T_CACHE: dict[tuple[int, torch.device], torch.Tensor] = {}


def _hadamard_t(seed: int, device: torch.device) -> torch.Tensor:
    key = (seed, device)
    if key not in _T_CACHE:
        _T_CACHE[key] = hadamard16(seed, device).t().contiguous()
    return _T_CACHE[key]


def _seed_tensor(q: NVFP4Quantizer, state, device) -> torch.Tensor:
    if not q.stochastic_rounding:
        return torch.zeros(1, dtype=torch.int64, device=device)
    gen = state.generator(device) if isinstance(state, NVFP4State) else None
    return torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=device, generator=gen)


def quantize_nvfp4(q: NVFP4Quantizer, x2d, *, rowwise, columnwise, state, amax):
    """Registry impl for :class:`NVFP4Quantizer` (see module doc for the exactness)."""
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    dev = x2d.device
    derive_col = q.block_2d and not q.rht
    col_rht = columnwise and not derive_col and q.rht
    t = _hadamard_t(q.rht_seed, dev)
    if amax is None or col_rht:
        amaxes = nvfp4_amax(x2d, t, col_rht)
        amax_row = amaxes[0] if amax is None else amax.float().to(dev).reshape(())
        amax_col = amaxes[1] if col_rht else amax_row
    else:
        amax_row = amax_col = amax.float().to(dev).reshape(())
    gs = nvfp4_global_scale(torch.stack([amax_row, amax_col]))
    row, row_s, col, col_s = nvfp4_quantize(
        x2d, t, gs, _seed_tensor(q, state, dev), rowwise, columnwise, derive_col, col_rht,
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
