"""Per-expert FP8 encode scales and their reciprocals, one Triton launch (compiled graphs).

For ``amax [E]`` (or given scales, delayed scaling) fp32:

    scale     [E] = fmax / max(amax, eps), 1 where that is 0, clamped to the fp32 max,
                    optionally floored to a power of two   (or the given ``scale``)
    scale_inv [E] = 1 / scale

with correctly rounded divisions (``_jit_common.per_block_scale``, ``div_rn``): bitwise
``numerics.scale_from_amax`` and ``torch.reciprocal`` on CUDA. Eager steps launch it in
place of those ten or so torch ops; a compiled graph calls it as the operator
``hybrid_dist::fp8_expert_scales`` instead of tracing them, which inductor would emit with
Triton's approximate division (an ulp off eager's).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_dist.kernels._jit_common import div_rn, eager_or_op, per_block_scale
from hybrid_dist.kernels._launch import launch
from hybrid_dist.kernels._traced import kernel_op, traced_launch

__all__ = ["fp8_expert_scales"]


@triton.jit
def _scales_kernel(amax_ptr, scale_in_ptr, scale_ptr, scale_inv_ptr, E, FMAX: tl.constexpr, EPS: tl.constexpr,
                   POW2: tl.constexpr, FROM_AMAX: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    m = i < E
    if FROM_AMAX:
        scale = per_block_scale(tl.load(amax_ptr + i, mask=m, other=0.0), FMAX, EPS, POW2)
    else:
        scale = tl.load(scale_in_ptr + i, mask=m, other=1.0)
    tl.store(scale_ptr + i, scale, mask=m)
    tl.store(scale_inv_ptr + i, div_rn(tl.zeros_like(scale) + 1.0, scale), mask=m)


def _fake(amax, scale, fmax, eps, pow2, from_amax):
    return amax.new_empty(amax.shape, dtype=torch.float32), amax.new_empty(amax.shape, dtype=torch.float32)


def _fp8_expert_scales(amax: torch.Tensor, scale: torch.Tensor, fmax: float, eps: float, pow2: bool,
                       from_amax: bool, run=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, scale_inv)`` fp32 ``[E]`` (module doc) of fp32 ``amax [E]`` (``from_amax``) or
    of the given ``scale [E]``; the unused input is not read."""
    e = amax.numel()
    out_scale = torch.empty(e, dtype=torch.float32, device=amax.device)
    out_inv = torch.empty(e, dtype=torch.float32, device=amax.device)
    if e:
        (run or launch)(_scales_kernel, (1,), amax, scale, out_scale, out_inv, e, FMAX=fmax, EPS=eps, POW2=pow2,
                        FROM_AMAX=from_amax, BLOCK=triton.next_power_of_2(e))
    return out_scale, out_inv


@kernel_op("hybrid_dist::fp8_expert_scales", fake=_fake)
def fp8_expert_scales_op(amax: torch.Tensor, scale: torch.Tensor, fmax: float, eps: float, pow2: bool,
                         from_amax: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``_fp8_expert_scales`` for compiled graphs: the same kernel and arguments."""
    return _fp8_expert_scales(amax, scale, fmax, eps, pow2, from_amax, traced_launch)


fp8_expert_scales = eager_or_op(fp8_expert_scales_op, _fp8_expert_scales)
