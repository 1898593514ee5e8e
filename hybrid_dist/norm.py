"""``hd.RMSNorm``: ``nn.RMSNorm`` over the last dim that can quantize its output once for
the ``hd.Linear`` layers reading it (``hd.link_quantized_input``; see ``shared_input``).

The math is PyTorch's own, ``F.rms_norm(x, (D,), weight, eps)`` (bitwise ``nn.RMSNorm``,
with its fused CUDA kernels forward and backward). Linked, the module normalizes exactly
so and then quantizes ``y [..., D]`` once with the consumers' shared input quantizer
(``_QuantizeShared``, a straight-through node: the gradient reaching the
``QuantizedTensor`` is ``y``'s gradient), so the fused forward quantizes the very values
each consumer would have quantized and the backward is ``F.rms_norm``'s in both cases:
fused and unfused are bitwise equal, outputs and gradients.

[Note: why no norm → FP8 kernel]
A kernel that never writes ``y`` must read ``x`` once per pass it needs ``y`` in
(rstd, amax, cast: 3 × 2 bytes per element for bf16, more with an fp32 rstd reduction in
torch), while ``F.rms_norm`` + one shared quantize moves ``x`` 2 + ``y`` 2 (write) + 2 + 2
(amax, cast reads) bytes: the same traffic, with PyTorch's fused norm kernels and no
second definition of the norm. The saving that counts is sharing: ``attention_norm``'s
output was quantized three times (wq, wk, wv) and ``ffn_norm``'s twice (w1, w3).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_dist.shared_input import QuantizedOutputProducer, quantize_shared


class RMSNorm(QuantizedOutputProducer, nn.RMSNorm):
    """Drop-in ``nn.RMSNorm(dim, eps)`` (parameter ``weight [dim]``, same state dict).

    ``forward(x [..., dim]) -> y [..., dim]``: ``F.rms_norm``'s output, or — when linked to
    ``hd.Linear`` consumers whose recipes allow it (``hd.link_quantized_input``) — that
    output quantized once into an ``hd.QuantizedTensor`` by their shared input quantizer.
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
        y = F.rms_norm(x, self.normalized_shape, self.weight, self.eps)
        target = self._shared_target()
        return y if target is None else quantize_shared(y, *target)
