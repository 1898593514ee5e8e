"""``kernels.fp8.scales``: per-expert FP8 scales and reciprocals, bitwise the torch ops eager
code runs (``numerics.scale_from_amax`` of the clamped amax, ``torch.reciprocal``), for
zero, subnormal, huge, infinite and NaN amaxes, every epsilon / power-of-two setting and
both FP8 maxima, and for given (delayed) scales. Under the Triton interpreter on the CPU
(a subprocess), whose divisions round correctly as the GPU's ``div_rn`` does."""

from __future__ import annotations

import torch

from tests._helpers import run_check_under_triton_interpreter

AMAX = [0.0, 1e-45, 1e-38, 2.5e-20, 1.0, 3.0, 448.0, 57344.0, 1e30, 3.4e38, float("inf"), float("nan")]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _check_expert_scales():
    from hybrid_dist.formats.numerics import FP8_MAX, scale_from_amax
    from hybrid_dist.kernels.fp8.scales import fp8_expert_scales

    gen = torch.Generator().manual_seed(0)
    amax = torch.cat([torch.tensor(AMAX), torch.rand(21, generator=gen) * 10.0 ** torch.randint(-30, 30, (21,),
                                                                                                  generator=gen)])
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        for eps in (0.0, 1e-12):
            for pow2 in (False, True):
                scale, inv = fp8_expert_scales(amax, amax, FP8_MAX[dtype], eps, pow2, True)
                ref = scale_from_amax(torch.clamp(amax, min=eps), FP8_MAX[dtype], pow2=pow2)
                what = f"{dtype} eps={eps} pow2={pow2}"
                assert torch.equal(_bits(scale), _bits(ref)), f"scale, {what}: {scale} vs {ref}"
                assert torch.equal(_bits(inv), _bits(torch.reciprocal(ref))), f"scale_inv, {what}"
    given = torch.cat([torch.tensor([0.0, 1e-40, 1.0, 3e38]), torch.rand(5, generator=gen) * 1e6])
    scale, inv = fp8_expert_scales(given, given, 448.0, 0.0, False, False)
    assert torch.equal(_bits(scale), _bits(given)) and torch.equal(_bits(inv), _bits(torch.reciprocal(given)))
    empty = torch.zeros(0)
    assert [t.shape for t in fp8_expert_scales(empty, empty, 448.0, 0.0, False, True)] == [(0,), (0,)]


def test_expert_scales_bitwise_the_torch_ops():
    run_check_under_triton_interpreter("tests.kernels.fp8.test_scales", "expert_scales", timeout=300)
