"""Delayed-scaling ``advance`` as one kernel: the next scale from the amax history, then
the history rolled by one slot — one launch instead of ~15 small torch ops, and no host
sync (the torch form's ``history[0] = 0.0`` copies a host scalar).

Bitwise ``DelayedScalingState.advance`` (``formats/float8.py``), for a history of length
``L`` (fp32 ``[L]``) and a 0-dim fp32 ``scale``, both updated in place — or for ``E`` such
states at once, stacked as ``history [E, L]`` and ``scale [E]`` (one program per state:
``moe.GroupedLinear``'s per-expert states, ``formats.float8.stacked_delayed_states``):

    amax  = max(history) ("max", NaN if any is NaN) or history[0] ("most_recent")
    s     = fmax / max(amax, eps) (IEEE division; 1 if that is 0), clamped to the fp32 max,
            times 2**-margin, optionally floored to a power of two
    scale = s if amax is finite and > 0, else unchanged
    history = [0, history[0], ..., history[L-2]]

While ``torch.compile`` traces, ``advance_`` calls the same kernel as the ``kernel_op``
``hybrid_dist::fp8_delayed_advance``; the torch form traced instead would divide with
Triton's approximate division in inductor's code (an ulp off eager's scale).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_dist.formats.numerics import FP8_MAX
from hybrid_dist.kernels._jit_common import FP32_MAX, div_rn, pow2_floor
from hybrid_dist.kernels._launch import launch
from hybrid_dist.kernels._traced import kernel_op, traced_launch


@triton.jit
def _advance_kernel(hist_ptr, scale_ptr, L, FMAX: tl.constexpr, EPS: tl.constexpr, MARGIN_MUL: tl.constexpr,
                    USE_MAX: tl.constexpr, POW2: tl.constexpr, BLOCK: tl.constexpr):
    hist_ptr += tl.program_id(0) * L  # state e of a stack: its history row and its scale
    scale_ptr += tl.program_id(0)
    idx = tl.arange(0, BLOCK)
    hist = tl.load(hist_ptr + idx, mask=idx < L, other=float("-inf"))
    # roll by one: slot i takes slot i-1; every load happens before the barrier, every store after
    shifted = tl.load(hist_ptr + idx - 1, mask=(idx >= 1) & (idx < L), other=0.0)
    old_scale = tl.load(scale_ptr)
    if USE_MAX:
        has_nan = tl.sum((hist != hist).to(tl.int32), axis=0) > 0
        amax = tl.max(hist, axis=0)
        amax = tl.where(has_nan, float("nan"), amax)
    else:
        amax = tl.sum(tl.where(idx == 0, hist, 0.0), axis=0)
    floored = tl.maximum(amax, EPS)
    floored = tl.where(amax != amax, amax, floored)  # clamp keeps NaN
    s = tl.where(floored > 0, div_rn(tl.zeros_like(floored) + FMAX, floored), 1.0)
    s = tl.minimum(s, FP32_MAX) * MARGIN_MUL
    if POW2:
        s = pow2_floor(s)
    keep = (amax != amax) | (tl.abs(amax) == float("inf")) | (amax <= 0)
    tl.debug_barrier()
    tl.store(scale_ptr, tl.where(keep, old_scale, s))
    tl.store(hist_ptr + idx, shifted, mask=idx < L)


def _advance(history, scale, fmax, eps, margin_mul, use_max, pow2, run):
    n = history.shape[-1]
    run(_advance_kernel, (1 if history.dim() == 1 else history.shape[0],), history, scale, n, FMAX=fmax, EPS=eps,
        MARGIN_MUL=margin_mul, USE_MAX=use_max, POW2=pow2, BLOCK=triton.next_power_of_2(max(n, 2)))


def _advance_fake(history, scale, fmax, eps, margin_mul, use_max, pow2):
    return None


@kernel_op("hybrid_dist::fp8_delayed_advance", mutates_args=("history", "scale"), fake=_advance_fake)
def advance_op(history: torch.Tensor, scale: torch.Tensor, fmax: float, eps: float, margin_mul: float,
               use_max: bool, pow2: bool) -> None:
    """``advance_`` for compiled graphs: the same kernel and arguments, so the same bits."""
    _advance(history, scale, fmax, eps, margin_mul, use_max, pow2, traced_launch)


def advance_(history: torch.Tensor, scale: torch.Tensor, quantizer) -> None:
    """In-place ``DelayedScalingState.advance`` on CUDA of one state (``[L]``, 0-dim) or of a
    stack (``[E, L]`` contiguous, ``[E]``; see the module doc)."""
    states = 1 if history.dim() == 1 else history.shape[0]
    if history.dim() == 2 and not (history.is_contiguous() and scale.shape == (states,) and scale.is_contiguous()):
        raise ValueError(f"advance_: a stack needs a contiguous history [E, L] and scale [E]; got "
                         f"{tuple(history.shape)} strides {history.stride()}, scale {tuple(scale.shape)}")
    args = (history, scale, FP8_MAX[quantizer.dtype], float(quantizer.amax_epsilon), 2.0 ** -quantizer.margin,
            quantizer.amax_compute == "max", quantizer.power_of_2_scales)
    if torch.compiler.is_compiling():
        advance_op(*args)
    else:
        _advance(*args, launch)
