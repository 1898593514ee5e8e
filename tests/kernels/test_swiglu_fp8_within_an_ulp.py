"""The fused SwiGLU → FP8 Triton kernel under the Triton interpreter, on CPU (runs
wherever Triton is installed; ``TRITON_INTERPRET=1`` in one subprocess).

Against the torch reference (``F.silu(a) * b``, then ``Float8Quantizer._quantize_2d``).
The interpreter's fp32 → fp8 cast rounds differently from the GPU's ``cvt.rn.satfinite``
and its ``exp`` is numpy's, not libdevice's: ``exp`` may differ by an ulp in fp32, which
moves ``h = bf16(silu(a))`` by at most one bf16 ulp on rare elements, so amax within 2
bf16 ulps (relative 2^-7), dequantized values within one E4M3 ulp plus that, and the
columnwise data the exact transpose of the rowwise data.

The bitwise comparison on the GPU is ``tests/kernels/test_swiglu_fp8.py``.
"""

from __future__ import annotations

import torch

from tests._helpers import run_under_triton_interpreter
from tests._tiers import slow

pytestmark = slow  # minutes of interpreted kernels on two cores: the slow tier

SHAPES = [(96, 256), (100, 200)]  # tile multiples and not (masked edges)
DIRS = [(True, True), (True, False), (False, True)]


def _e4m3_ulp(v: torch.Tensor) -> torch.Tensor:
    """One E4M3 ulp at ``|v|`` (in the scaled domain): 2^(e-3), subnormal step 2^-9."""
    e = torch.floor(torch.log2(v.abs().clamp(min=2.0**-6)))
    return torch.exp2(e - 3)


def _check_close(k, r, what, extra_rel=0.0):
    """Kernel and reference storages (row, col): transposes agree, fp8 values within one
    ulp — except where the reference rounds up to a power of two: the interpreter's cast
    drops that carry into the exponent and gives half of it (also seen by
    ``test_quantize_kernels_exact_casts``)."""
    kd = k[0].data.float() if k[0] is not None else k[1].data.float().t()
    rd = r[0].data.float() if r[0] is not None else r[1].data.float().t()
    tol = _e4m3_ulp(rd) + extra_rel * rd.abs() + 1e-12
    pow2 = (rd != 0) & (torch.frexp(rd).mantissa.abs() == 0.5)
    carry = pow2 & (kd == rd / 2)
    bad = (((kd - rd).abs() > tol) & ~carry).sum().item()
    assert bad == 0, f"{what}: {bad} values beyond one E4M3 ulp"
    assert (kd == rd).float().mean() > 0.9, f"{what}: fewer than 90% of the fp8 values equal"
    if k[0] is not None and k[1] is not None:
        assert torch.equal(k[1].data.view(torch.uint8), k[0].data.t().contiguous().view(torch.uint8)), what


def _check_swiglu():
    import torch.nn.functional as F

    import hybrid_dist as hd
    from hybrid_dist.kernels import swiglu_fp8

    gen = torch.Generator().manual_seed(1)
    q = hd.Float8Quantizer()
    for m, k in SHAPES:
        a, b = ((torch.randn(m, k, generator=gen) * 3).bfloat16() for _ in range(2))
        h = F.silu(a) * b
        for rw, cw in DIRS:
            kern = swiglu_fp8.swiglu_quantize_fp8(q, a, b, rowwise=rw, columnwise=cw)
            ref = q._quantize_2d(h, rowwise=rw, columnwise=cw, state=None, amax=None)
            ks, rs = [p[0] if p[0] is not None else p[1] for p in (kern, ref)]
            what = f"swiglu {m}x{k} dirs={rw, cw}"
            torch.testing.assert_close(ks.scale_inv, rs.scale_inv, rtol=2**-7, atol=0, msg=what)
            _check_close(kern, ref, what, extra_rel=2**-6)
    print("SWIGLU_OK")


def test_swiglu_fp8_kernel_under_interpreter():
    run_under_triton_interpreter("from tests.kernels.test_swiglu_fp8_within_an_ulp import _check_swiglu\n"
                                 "_check_swiglu()", done="SWIGLU_OK")
