"""``hd.SwiGLU``: the gated activation ``silu(a) * b`` of a SwiGLU MLP, which can quantize
its output once for the ``hd.Linear`` reading it (``w2``; ``hd.link_quantized_input``).

The math is torch's, op for op (``swiglu_reference``): ``h = F.silu(a)`` (computed in
fp32, ``a / (1 + exp(-a))``, rounded to ``a.dtype``), then ``h * b`` (rounded to the
promoted dtype). The fused CUDA kernel recomputes exactly these roundings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_dist import _kernel_registry
from hybrid_dist.quantized_tensor import QuantizedTensor
from hybrid_dist.shared_input import QuantizedOutputProducer


def swiglu_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``F.silu(a) * b`` (differentiable)."""
    return F.silu(a) * b


def _swiglu_storages(a, b, quantizer, columnwise):
    """``(row, col, dtype)``: the fused kernel if one serves ``quantizer`` here, else the
    formula then one ``quantize_storages``."""
    k = a.shape[-1]
    impl = _kernel_registry.fused_quantize_impl_for("swiglu", quantizer, a)
    if impl is not None:
        out = impl(quantizer, a.reshape(-1, k), b.reshape(-1, k), rowwise=True, columnwise=columnwise)
        if out is not NotImplemented:
            return (*out, torch.result_type(a, b))
    h = swiglu_reference(a, b)
    return (*quantizer.quantize_storages(h.reshape(-1, k), rowwise=True, columnwise=columnwise), h.dtype)


class _SwiGLUQuantizedFn(torch.autograd.Function):
    """``silu(a) * b`` as a QuantizedTensor. Backward runs the ops autograd runs for the
    plain formula (``MulBackward0``: ``dh · b`` and ``dh · silu(a)``; ``SiluBackward0``:
    ``silu_backward``), recomputing only ``silu(a)`` (the fused forward never wrote it):
    bitwise the plain path's gradients, without re-running the product."""

    @staticmethod
    def forward(ctx, a, b, quantizer, columnwise: bool):
        ctx.set_materialize_grads(False)
        row, col, dtype = _swiglu_storages(a, b, quantizer, columnwise)
        ctx.save_for_backward(a, b)
        return QuantizedTensor(a.shape, dtype, row, col, quantizer)

    @staticmethod
    def backward(ctx, dh):
        need_a, need_b = ctx.needs_input_grad[:2]
        if dh is None or not (need_a or need_b):
            return None, None, None, None
        a, b = ctx.saved_tensors
        if not (a.dtype == b.dtype == dh.dtype):  # mixed dtypes: let autograd do the promotions
            with torch.enable_grad():
                a_, b_ = a.detach().requires_grad_(need_a), b.detach().requires_grad_(need_b)
                grads = iter(torch.autograd.grad(swiglu_reference(a_, b_), [t for t in (a_, b_) if t.requires_grad],
                                                 dh))
            return (next(grads) if need_a else None), (next(grads) if need_b else None), None, None
        da = torch.ops.aten.silu_backward(dh * b, a) if need_a else None
        db = dh * F.silu(a) if need_b else None
        return da, db, None, None


class SwiGLU(QuantizedOutputProducer, nn.Module):
    """``forward(a [..., F], b [..., F]) -> silu(a) * b [..., F]``: a plain tensor, or one
    ``hd.QuantizedTensor`` when linked to ``hd.Linear`` consumers whose recipes allow it.
    No parameters (nothing in the state dict)."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if a.shape != b.shape:
            raise ValueError(f"hd.SwiGLU expects a and b of one shape, got {tuple(a.shape)} and {tuple(b.shape)}; "
                             "pass the gate projection's output as a and the up projection's as b")
        target = self._shared_target()
        if target is None:
            return swiglu_reference(a, b)
        return _SwiGLUQuantizedFn.apply(a, b, *target)
