"""``kernels._jit_common``'s helpers against the reference.

The NVFP4 block scale on the GPU: the divisions by a reciprocal
(``div_by_rcp``) and ``rcp.rn`` against the reference's IEEE divisions, bitwise, on random
fp32 block amaxes down to 100 binades below the tensor amax, and global scales from tensor amaxes ``2**-140 .. 2**100``
(below ``2**-80`` the IEEE divisions, down to a tiny tensor's global scale ``2**-128`` whose
encode multiplier is clamped at the fp32 max), plus zeros, infinities and an inf global scale. The saturating fp8 cast (``cast_fp8``) in
every FP8 / MXFP8 kernel on the GPU: the reference's bytes for non-finite and overflowing
values. The bf16 E8M0 helpers under the Triton interpreter (CPU, the slow tier): equal to the
general ones on every bf16 amax.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")  # absent on CPU-only installs (CI)
import triton.language as tl  # noqa: E402

from hybrid_dist.formats.numerics import cast_to_fp8  # noqa: E402
from hybrid_dist.formats.nvfp4 import nvfp4_global_scale  # noqa: E402
import hybrid_dist as hd  # noqa: E402
from hybrid_dist.kernels._jit_common import nvfp4_block_scale  # noqa: E402
from tests._helpers import run_under_triton_interpreter  # noqa: E402
from tests._kernel_helpers import assert_storages_bitwise, kernel_quantize, reference_quantize  # noqa: E402
from tests._tiers import slow  # noqa: E402
from tests.kernels._quantize_checks import E4M3, E5M2, check_bitwise, cuda_delayed_state, make_x  # noqa: E402


@triton.jit
def _block_scale_probe(a_ptr, gs_ptr, bs_ptr, enc_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    a = tl.load(a_ptr + offs, mask=offs < n, other=0.0)
    bs, enc = nvfp4_block_scale(a, tl.load(gs_ptr))
    tl.store(bs_ptr + offs, bs, mask=offs < n)
    tl.store(enc_ptr + offs, enc, mask=offs < n)


def _reference(a, gs):
    """``formats.nvfp4.nvfp4_quantize_rows``' block-scale lines on the block amaxes ``a``."""
    bs = cast_to_fp8(a / torch.full_like(a, 6.0) / gs, torch.float8_e4m3fn)
    denom = bs.float() * gs
    enc = torch.reciprocal(denom).clamp(max=torch.finfo(torch.float32).max)
    return bs, torch.where(denom > 0, enc, torch.zeros_like(denom))


def _random_fp32(n, lo_exp, hi_exp, gen):
    """Positive fp32 with uniformly random significand bits and exponents in [lo, hi)
    (``lo >= -149``; below ``-126`` subnormal: normal values scaled down by ``2**64``)."""
    shift = 64 if lo_exp < -126 else 0
    e = torch.randint(lo_exp + shift + 127, hi_exp + shift + 127, (n,), generator=gen, device="cuda",
                      dtype=torch.int32)
    m = torch.randint(0, 1 << 23, (n,), generator=gen, device="cuda", dtype=torch.int32)
    return ((e << 23) | m).view(torch.float32) * 2.0**-shift


@pytest.mark.gpu
@pytest.mark.parametrize("amax_exp", [-140, -128, -126, -120, -100, -92, -80, -40, -3, 0, 2, 11, 60, 100])
def test_nvfp4_block_scale_bitwise_the_ieee_divisions(amax_exp):
    gen = torch.Generator(device="cuda").manual_seed(amax_exp + 1000)
    n = 1 << 20
    amax = _random_fp32(1, amax_exp, amax_exp + 1, gen)  # the tensor amax behind gs
    gs = nvfp4_global_scale(amax).reshape(())
    a = torch.minimum(_random_fp32(n, max(amax_exp - 100, -149), amax_exp + 1, gen), amax)  # block amax <= amax
    a[:4] = torch.tensor([0.0, float("inf"), 2.0**-149, 3.4e38], device="cuda").clamp(max=amax.item())
    bs, enc = torch.empty(n, dtype=torch.float8_e4m3fn, device="cuda"), torch.empty(n, device="cuda")
    _block_scale_probe[(triton.cdiv(n, 1024),)](a, gs, bs, enc, n, BLOCK=1024)
    ref_bs, ref_enc = _reference(a, gs)
    bad = (bs.view(torch.uint8) != ref_bs.view(torch.uint8)) | (enc.view(torch.int32) != ref_enc.view(torch.int32))
    assert not bad.any(), (f"amax 2**{amax_exp}: {int(bad.sum())} of {n} block scales differ, first "
                           f"a={a[bad][0].item()!r} gs={gs.item()!r}")


@pytest.mark.gpu
def test_nvfp4_block_scale_with_an_infinite_global_scale():
    """An inf tensor amax gives ``gs = inf``: finite block amaxes divide to 0, inf to NaN."""
    a = torch.tensor([0.0, 1.0, 3e38, float("inf")], device="cuda")
    gs = torch.tensor(float("inf"), device="cuda")
    bs, enc = torch.empty(4, dtype=torch.float8_e4m3fn, device="cuda"), torch.empty(4, device="cuda")
    _block_scale_probe[(1,)](a, gs, bs, enc, 4, BLOCK=16)
    ref_bs, ref_enc = _reference(a, gs)
    assert torch.equal(bs.view(torch.uint8), ref_bs.view(torch.uint8)), (bs, ref_bs)
    assert torch.equal(enc.view(torch.int32), ref_enc.view(torch.int32)), (enc, ref_enc)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=str)
def test_fp8_casts_saturate_like_the_reference(dtype):
    """The kernels cast without a clamp (``cvt.rn.satfinite``, ``_jit_common.cast_fp8``);
    the reference clamps, then casts. Same bytes for ±inf inputs, for scaled values past
    fp8_max (a precomputed amax below the data's), and for blocks whose amax is inf
    (scale 0: the inf elements become inf·0 = NaN, the others 0)."""
    x = make_x((384, 640))
    x[5, 7], x[200, 300], x[130, 600] = float("inf"), float("-inf"), 3e38
    cases = [(hd.Float8Quantizer(dtype=dtype), {"amax": torch.tensor(3.0, device="cuda")}),
             (hd.Float8Quantizer(dtype=dtype, scaling="delayed"), {"state": cuda_delayed_state(dtype)}),
             (hd.Float8BlockQuantizer(block="1x128", dtype=dtype), {}),
             (hd.Float8BlockQuantizer(block="128x128", dtype=dtype), {}),
             (hd.MXFP8Quantizer(dtype=dtype), {})]
    for q, kw in cases:
        what = f"{type(q).__name__} {getattr(q, 'block', getattr(q, 'scaling', ''))} {dtype} non-finite"
        if "state" in kw:  # each side advances its own copy of the delayed-scaling state
            k = kernel_quantize(q, x, rowwise=True, columnwise=True, state=kw["state"])
            r = reference_quantize(q, x, rowwise=True, columnwise=True, state=cuda_delayed_state(dtype))
            assert_storages_bitwise(k[0], r[0], f"{what} rowwise")
            assert_storages_bitwise(k[1], r[1], f"{what} columnwise")
        else:
            check_bitwise(q, x, True, True, what, **kw)


def _check_e8m0_bf16_helpers():
    """``e8m0_rceil_bf16`` / ``e8m0_inv_bf16`` equal ``e8m0_rceil`` / ``exp2_int(127 - e)`` on
    every non-negative bf16 amax (all 2**15 bit patterns, inf and NaN included)."""
    import triton

    from tests._triton_probes import e8m0_probe

    amax = (torch.arange(0, 2**15, dtype=torch.int32) << 16).view(torch.float32)
    n = amax.numel()
    for e5m2 in (False, True):
        out = torch.empty(4 * n, dtype=torch.int32)
        e8m0_probe[(triton.cdiv(n, 1024),)](amax, out, n, E5M2=e5m2, BLOCK=1024)
        what = f"e8m0 bf16 helpers (E5M2={e5m2})"
        assert torch.equal(out[:n], out[n:2 * n]), f"{what}: codes differ at {(out[:n] != out[n:2 * n]).sum()} amax"
        assert torch.equal(out[2 * n:3 * n], out[3 * n:]), f"{what}: multipliers differ"


@slow  # minutes of interpreted kernels on two cores: the slow tier
def test_e8m0_bf16_helpers_under_triton_interpreter():
    run_under_triton_interpreter("from tests.kernels.test_jit_common import _check_e8m0_bf16_helpers as c\n"
                                 "c()\nprint('e8m0_bf16_helpers passed')", done="e8m0_bf16_helpers passed")
