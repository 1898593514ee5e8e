"""``launch.grad_clip.clip_grad_norm_`` on plain (single-process) parameters equals
``torch.nn.utils.clip_grad_norm_``: the same total norm and the same scaled gradients
(within fp32 rounding of the norm), for fp32 and bf16 gradients, clipped and not."""

from __future__ import annotations

import pytest
import torch

from hybrid_dist.launch.grad_clip import clip_grad_norm_


@pytest.mark.parametrize("max_norm", [0.5, 1e3], ids=["clipped", "not-clipped"])
def test_clip_matches_torch(max_norm):
    g = torch.Generator().manual_seed(0)
    shapes, dtypes = [(64, 32), (7,), (128, 16)], [torch.float32, torch.bfloat16, torch.float32]
    ours = [torch.nn.Parameter(torch.zeros(s, dtype=d)) for s, d in zip(shapes, dtypes)]
    ref = [torch.nn.Parameter(torch.zeros(s, dtype=d)) for s, d in zip(shapes, dtypes)]
    for a, b in zip(ours, ref):
        a.grad = torch.randn(a.shape, generator=g).to(a.dtype)
        b.grad = a.grad.clone()
    norm = clip_grad_norm_(ours, max_norm)
    norm_ref = torch.nn.utils.clip_grad_norm_(ref, max_norm)
    torch.testing.assert_close(norm, norm_ref.float(), rtol=1e-6, atol=0)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5 if a.dtype == torch.float32 else 1e-2, atol=0)
