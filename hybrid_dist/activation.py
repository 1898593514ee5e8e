"""``hd.SwiGLU``: the gated activation ``silu(a) * b`` of a SwiGLU MLP, which can quantize
its output once for the ``hd.Linear`` reading it (``w2``; ``hd.link_quantized_input``).

The math is torch's, op for op (``swiglu_reference``): ``h = F.silu(a)`` (computed in
fp32, ``a / (1 + exp(-a))``, rounded to ``a.dtype``), then ``h * b`` (rounded to the
promoted dtype). The fused CUDA kernel recomputes exactly these roundings.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_dist import kernels
from hybrid_dist.shared_input import QuantizedOutputProducer, produce_quantized, reference_storages


def swiglu_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``F.silu(a) * b`` (differentiable)."""
    return F.silu(a) * b


def _swiglu_storages(a, b, *, quantizer, columnwise):
    """``(row, col, dtype)``: the fused kernel if one serves ``quantizer`` here, else the
    reference then one quantize."""
    impl = kernels.fused_quantize_impl_for("swiglu", quantizer, a)
    if impl is not None and a.shape == b.shape:
        k = a.shape[-1]
        out = impl(quantizer, a.reshape(-1, k), b.reshape(-1, k), rowwise=True, columnwise=columnwise)
        if out is not NotImplemented:
            return (*out, torch.result_type(a, b))
    return reference_storages(swiglu_reference, quantizer, columnwise, a, b)


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
        quantizer, columnwise = target
        storages = functools.partial(_swiglu_storages, quantizer=quantizer, columnwise=columnwise)
        return produce_quantized(swiglu_reference, storages, quantizer, a, b)
