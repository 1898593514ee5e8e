"""``hd.RMSNorm``: ``nn.RMSNorm`` over the last dim that can quantize its output once for
the ``hd.Linear`` layers reading it (``hd.link_quantized_input``; see ``shared_input``).

The math (``rms_norm_reference``, pure torch; the fused CUDA kernel reproduces it bitwise),
for ``x [..., D]``, ``weight [D]``, with ``xf = x`` in fp32 (fp64 stays fp64):

    rstd [..., 1] = rsqrt(mean(xf², dim=-1) + eps)        one torch reduction
    y    [..., D] = ((xf · rstd) → x.dtype) · weight  → x.dtype

Backward is hand-written (:func:`rms_norm_backward`, fp32, tested against autograd of the
formula) and the module is one autograd node whether its output is plain or quantized,
so fused and unfused gradients are bitwise equal.

``eps=None`` is the machine epsilon of the compute dtype (fp32 for bf16/fp16 inputs), as
``torch.rms_norm`` uses. This is torch's composite ``rms_norm`` (upcast, normalize, cast
back, scale): bitwise ``nn.RMSNorm`` for fp32 inputs. For bf16 inputs torch dispatches
``nn.RMSNorm`` to a fused kernel that rounds ``x·rstd·w`` once (and on CUDA may sum in
another order): outputs differ there by up to one bf16 ulp. This module therefore
defines its own formula and uses it whether it fuses or not. The output dtype is ``x.dtype`` (the
activation dtype the consumers quantize), also when ``weight`` is fp32.
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid_dist import kernels
from hybrid_dist.quantized_tensor import QuantizedTensor
from hybrid_dist.shared_input import QuantizedOutputProducer


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def rms_norm_rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``rsqrt(mean(x², -1) + eps)`` in fp32 (fp64 for fp64 ``x``), shape ``[..., 1]``."""
    xf = x.to(_compute_dtype(x))
    return torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm_apply(x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``((x · rstd) → x.dtype) · weight → x.dtype``, with ``rstd`` from :func:`rms_norm_rstd`."""
    xf = x.to(_compute_dtype(x))
    return ((xf * rstd).to(x.dtype) * weight).to(x.dtype)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The RMSNorm of this module (see the module docstring); differentiable."""
    return rms_norm_apply(x, rms_norm_rstd(x, eps), weight)


def rms_norm_backward(dy, x, weight, rstd, *, need_dx: bool, need_dw: bool):
    """``(dx or None, dw or None)`` of :func:`rms_norm_reference`, in fp32 (fp64 for fp64)
    with the forward's roundings passed straight through:

        dn [..., D] = dy · w                    (the gradient at x·rstd)
        dx          = rstd · (dn − x · rstd² · mean(dn · x, -1))
        dw [D]      = Σ_rows dy · ((x · rstd) → x.dtype)
    """
    cd = _compute_dtype(x)
    xf, dyf = x.to(cd), dy.to(cd)
    dx = dw = None
    if need_dx:
        dn = dyf * weight.to(cd)
        dx = (rstd * (dn - xf * (rstd * rstd) * (dn * xf).mean(-1, keepdim=True))).to(x.dtype)
    if need_dw:
        n = (xf * rstd).to(x.dtype).to(cd)
        dw = (dyf * n).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    return dx, dw


def _norm_storages(x, rstd, weight, quantizer, columnwise):
    """``(row, col)`` of the quantized norm output: the fused kernel where one is registered
    for ``quantizer`` on ``x``'s device, else the formula then one ``quantize_storages``."""
    x2d = x.reshape(-1, x.shape[-1])
    impl = kernels.fused_quantize_impl_for("rms_norm", quantizer, x2d)
    if impl is not None:
        out = impl(quantizer, x2d, rstd.reshape(-1), weight, rowwise=True, columnwise=columnwise)
        if out is not NotImplemented:
            return out
    y2d = rms_norm_apply(x, rstd, weight).reshape(-1, x.shape[-1])
    return quantizer.quantize_storages(y2d, rowwise=True, columnwise=columnwise)


class _RMSNormFn(torch.autograd.Function):
    """One autograd node for the norm, fused or not, so that the input's gradient is
    summed the same way in both (``x`` feeds the residual too). ``target``: None for the
    plain output, else ``(quantizer, columnwise)`` for a QuantizedTensor output."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, target):
        rstd = rms_norm_rstd(x, eps)
        ctx.save_for_backward(x, weight, rstd)
        if target is None:
            return rms_norm_apply(x, rstd, weight)
        quantizer, columnwise = target
        row, col = _norm_storages(x, rstd, weight, quantizer, columnwise)
        return QuantizedTensor(x.shape, x.dtype, row, col, quantizer)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy, x, weight, rstd, need_dx=ctx.needs_input_grad[0],
                                   need_dw=ctx.needs_input_grad[1])
        return dx, dw, None, None


class RMSNorm(QuantizedOutputProducer, nn.RMSNorm):
    """Drop-in ``nn.RMSNorm(dim, eps)`` (parameter ``weight [dim]``, same state dict).

    ``forward(x [..., dim]) -> y [..., dim]`` of ``x.dtype``: a plain tensor, or — when
    linked to ``hd.Linear`` consumers whose recipes allow it (``hd.link_quantized_input``)
    — one ``hd.QuantizedTensor`` quantized by their shared input quantizer. Backward is
    :func:`rms_norm_backward` either way.
    """

    def __init__(self, dim: int, eps: float | None = None, *, device=None, dtype=None):
        if not isinstance(dim, int) or dim < 1:
            raise ValueError(f"hd.RMSNorm normalizes the last dim: dim must be a positive int, got {dim!r}")
        super().__init__(dim, eps=eps, elementwise_affine=True, device=device, dtype=dtype)

    def output_features(self) -> int:
        return self.normalized_shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.normalized_shape[0]:
            raise ValueError(f"hd.RMSNorm({self.normalized_shape[0]}) expects input [..., "
                             f"{self.normalized_shape[0]}], got {tuple(x.shape)}")
        eps = torch.finfo(_compute_dtype(x)).eps if self.eps is None else self.eps
        return _RMSNormFn.apply(x, self.weight, eps, self._shared_target())
