"""NVFP4 stochastic rounding for ``split_quantize_packed`` without host-built tensors.

The reference ``e2m1_encode(v, rand)`` looks the E2M1 grid up in a tensor built on the
host (``torch.tensor(E2M1_GRID, device=...)``): on CUDA that is a blocking host-to-device
copy, which ``torch.cuda.set_sync_debug_mode("error")`` rejects. Here the grid is
evaluated from scalar thresholds instead; the fp32 operations are the reference's, so
with the same ``rand`` the codes are bitwise the reference's (tested on CPU).

    lo      = #{g in grid[1:] : |v| >= g}, clamped to 6     (= bucketize(right=True) - 1)
    p_up    = (|v| - grid[lo]) / (grid[lo+1] - grid[lo])
    code    = lo + (rand < p_up),  sign in bit 3
"""

from __future__ import annotations

import torch

from hybrid_dist.formats._numerics import E2M1_GRID, E2M1_MAX, cast_to_fp8, pack_fp4
from hybrid_dist.formats.nvfp4 import NV_BLOCK

__all__ = ["e2m1_encode_sr", "nvfp4_quantize_rows_sr"]


def _grid(i: torch.Tensor) -> torch.Tensor:
    """fp32 ``E2M1_GRID[i]`` for integer ``i`` in [0, 7], from scalars."""
    g = torch.zeros(i.shape, dtype=torch.float32, device=i.device)
    for k, val in enumerate(E2M1_GRID[1:], start=1):
        g = torch.where(i == k, val, g)
    return g


def e2m1_encode_sr(v: torch.Tensor, rand: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, sign in bit 3) of fp32 ``v`` in [-6, 6], rounded stochastically
    with uniform ``rand`` (v's shape); bitwise ``e2m1_encode(v, rand)``."""
    mag = v.abs().clamp(max=E2M1_MAX)
    lo = torch.zeros(mag.shape, dtype=torch.uint8, device=mag.device)  # small: the buffer is [C, K]
    for t in E2M1_GRID[1:]:
        lo += (mag >= t).to(torch.uint8)
    lo = lo.clamp(0, 6)
    lo_val, hi_val = _grid(lo), _grid(lo + 1)
    p_up = (mag - lo_val) / (hi_val - lo_val)
    code = (lo + (rand < p_up).to(lo.dtype)).to(torch.uint8)
    return code | ((v < 0).to(torch.uint8) << 3)


def nvfp4_quantize_rows_sr(x: torch.Tensor, global_scale: torch.Tensor, rand: torch.Tensor):
    """``nvfp4_quantize_rows(x, global_scale, block_rows=1, rand=rand)`` (1D blocks along
    C) with the sync-free encode: ``(packed data [R, C/2], block_scale [R, C/16])``."""
    r, c = x.shape
    blocks = x.float().reshape(r, 1, c // NV_BLOCK, NV_BLOCK)
    block_amax = blocks.abs().amax(dim=(1, 3))
    per_element = block_amax / torch.full_like(block_amax, E2M1_MAX)
    block_scale = cast_to_fp8(per_element / global_scale, torch.float8_e4m3fn)
    denom = block_scale.float() * global_scale
    encode = torch.where(denom > 0, torch.reciprocal(denom), torch.zeros_like(denom))
    scaled = (blocks * encode[:, None, :, None]).clamp(-E2M1_MAX, E2M1_MAX).reshape(r, c)
    return pack_fp4(e2m1_encode_sr(scaled, rand)), block_scale
