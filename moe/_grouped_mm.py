"""High-precision grouped GEMMs: ``torch._grouped_mm`` on CUDA, a loop on CPU.

``torch._grouped_mm`` takes the group boundaries as a device ``offs`` tensor (int32
cumulative token counts), so the CUDA path makes no device-to-host sync:

    fprop  y  [T, N]    = _grouped_mm(x [T, K],    Wᵀ [E, K, N], offs)
    dgrad  dx [T, K]    = _grouped_mm(dy [T, N],   W  [E, N, K], offs)
    wgrad  dW [E, N, K] = _grouped_mm(dyᵀ [N, T],  x  [T, K],    offs)   (groups along T)

It serves recipes whose every role is the identity quantizer in both directions (the
``bf16`` recipe) with bf16 operands whose dims are multiples of 8 (16-byte rows, as the
kernel needs). Anything else uses the quantized reference path of ``grouped_linear``.
GPU path: covered by ``@pytest.mark.gpu`` tests only (CI has no GPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid_dist.formats.identity import IdentityQuantizer, IdentityStorage
from hybrid_dist.moe.exchange_io import hand_off_input_grad, input_grad_sender
from hybrid_dist.linear import DequantizeFn
from hybrid_dist.quantized_tensor import QuantizedTensor


def _is_identity(q) -> bool:
    return all(isinstance(q.direction_quantizer(d), IdentityQuantizer) and q.direction_quantizer(d).dtype is None
               for d in ("rowwise", "columnwise"))


def available() -> bool:
    return hasattr(torch, "_grouped_mm")


def fits(plan, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when the ``torch._grouped_mm`` path computes this call (see module doc)."""
    recipe = plan.recipe
    return (
        available() and x.is_cuda and x.dtype == torch.bfloat16
        and not isinstance(weight, QuantizedTensor) and weight.dtype == torch.bfloat16
        and all(_is_identity(q) for q in (plan.input, plan.weight, plan.grad_output))
        and all(c.out_dtype in (None, torch.bfloat16) for c in (recipe.fprop, recipe.dgrad, recipe.wgrad))
        and x.shape[1] % 8 == 0 and weight.shape[1] % 8 == 0
    )


def _offs(tokens_per_expert: torch.Tensor) -> torch.Tensor:
    return tokens_per_expert.cumsum(0).to(torch.int32)


def _identity_cols(t: torch.Tensor) -> list[IdentityStorage]:
    """Each expert's ``[N, K]`` as a columnwise identity storage (stored ``[K, N]``: a view)."""
    return [IdentityStorage(data=w.t(), transposed=True) for w in t]


def _record(stats, tensor_type: str, t: torch.Tensor, offs: torch.Tensor, columnwise: bool, *,
            rowwise: bool = True) -> None:
    """Statistics rows of a token operand ``t [T, ·]`` grouped by ``offs`` (no padding)."""
    t = t.detach()
    bounds = torch.cat([offs.new_zeros(1), offs]).long()
    stats.record_experts(tensor_type, t, [IdentityStorage(data=t, transposed=False)] if rowwise else None,
                         [IdentityStorage(data=t.t(), transposed=True)] if columnwise else None,
                         num_experts=offs.numel(), offsets=bounds, poff=bounds)


class _GroupedMMFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, tokens_per_expert, stats, io):
        offs = _offs(tokens_per_expert)
        ctx.save_for_backward(x, weight, offs)
        ctx.stats, ctx.dx_sender = stats, input_grad_sender(io)
        if stats is not None:
            _record(stats, "input", x, offs, ctx.needs_input_grad[1])
            e = weight.shape[0]
            stats.record_experts("weight", weight, [IdentityStorage(data=w, transposed=False) for w in weight.detach()],
                                 _identity_cols(weight.detach()) if ctx.needs_input_grad[0] else None, num_experts=e)
        # fprop: y [T, N] = x [T, K] · W_e [N, K]ᵀ per group
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offs)

    @staticmethod
    def backward(ctx, dy):
        x, weight, offs = ctx.saved_tensors
        dy = dy.contiguous()
        if ctx.stats is not None:
            _record(ctx.stats, "grad_output", dy, offs, ctx.needs_input_grad[1], rowwise=ctx.needs_input_grad[0])
        dx = dw = None
        if ctx.needs_input_grad[0]:
            # dgrad: dx [T, K] = dy [T, N] · W_e [N, K]
            dx = hand_off_input_grad(ctx.dx_sender, torch._grouped_mm(dy, weight, offs=offs))
        if ctx.needs_input_grad[1]:
            # wgrad: dW [E, N, K] = dyᵀ [N, T] · x [T, K], groups along T
            dw = torch._grouped_mm(dy.t(), x, offs=offs)
        return dx, dw, None, None, None


def grouped_mm_linear(x, weight, tokens_per_expert, stats=None, io=None) -> torch.Tensor:
    """``y [T, N]``; ``stats``: the plan's ``inspection.ModuleStats`` while a logging step
    captures (the high-precision rows and their candidate formats), else None; ``io``: an
    expert-parallel ``ExchangeIO`` whose early sender takes dx (``hand_off_input_grad``)."""
    return _GroupedMMFn.apply(x, weight, tokens_per_expert, stats, io)


def high_precision(x, weight, tokens_per_expert, io=None) -> torch.Tensor:
    """No recipe: plain math (``_grouped_mm`` on CUDA bf16, else a per-expert loop that
    reads the split sizes on the host); ``io`` as ``grouped_mm_linear``'s."""
    if isinstance(weight, QuantizedTensor):
        weight = DequantizeFn.apply(weight, x.dtype)
    if available() and x.is_cuda and x.dtype == weight.dtype == torch.bfloat16:
        return grouped_mm_linear(x, weight, tokens_per_expert, io=io)
    splits = tokens_per_expert.tolist()
    outs = [F.linear(xe, weight[i]) for i, xe in enumerate(torch.split(x, splits))]
    return torch.cat(outs) if outs else x.new_zeros(0, weight.shape[1])
