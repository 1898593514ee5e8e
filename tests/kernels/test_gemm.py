"""Every GEMM format pair on the CUDA backend against the reference GEMM, on the GPU.

The CUDA paths multiply the same exactly-dequantized operands with fp32 accumulation, so
they differ from the reference only in summation order (fp32 output: rel. error < 1e-5)
and in the final rounding (bf16 output: < 1e-2 of the norm, i.e. one bf16 rounding). A
bf16 output with per-tensor scales folds them into one operand's dequantize: each product
term within 2⁻⁸ of the reference's, asserted elementwise.
Exception: FP8 × FP8 through cuBLAS (``_scaled_mm``, tensorwise and blockwise) — Hopper's
FP8 tensor cores accumulate with fewer than fp32's mantissa bits between promotions,
measured ~1.3e-4 relative at K=512, so those pairs get 5e-4.
"""

from __future__ import annotations

import pytest
import torch

import hybrid_dist as hd
from hybrid_dist import kernels
from hybrid_dist.gemm import GemmConfig, gemm_nt, reference_gemm_nt

pytestmark = pytest.mark.gpu
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
M, N, K = 256, 384, 512

# name -> (quantizer for A, quantizer for B): A's rows and B's rows both contract over K
FORMATS = {
    "fp8_e4m3": hd.Float8Quantizer(dtype=E4M3),
    "fp8_e5m2": hd.Float8Quantizer(dtype=E5M2),
    "mxfp8": hd.MXFP8Quantizer(),
    "nvfp4": hd.NVFP4Quantizer(),
    "nvfp4_2d": hd.NVFP4Quantizer(block_2d=True),
    "bf16": hd.IdentityQuantizer(),
}
PAIRS = [(a, b) for a in FORMATS for b in FORMATS]
BLOCK_PAIRS = [("1x128", "128x128"), ("1x128", "1x128"), ("128x128", "1x128"), ("128x128", "128x128")]


def _operands(qa, qb, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    b = torch.randn(N, K, device="cuda", generator=g).bfloat16()
    sa = qa.quantize_storages(a, rowwise=True, columnwise=False)[0]
    sb = qb.quantize_storages(b, rowwise=True, columnwise=False)[0]
    return sa, sb


def _rel(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def _check(sa, sb, what, fp32_tol=1e-5):
    assert kernels.gemm_impls_for(sa.device), "no CUDA GEMM registered"
    for out_dtype, tol in ((torch.float32, fp32_tol), (torch.bfloat16, 1e-2)):
        ref = reference_gemm_nt(sa, sb, out_dtype=torch.float32)
        out = gemm_nt(sa, sb, out_dtype=out_dtype, config=GemmConfig())
        assert out.dtype == out_dtype and out.shape == ref.shape, what
        err = _rel(out, ref)
        assert err < tol, f"{what} out={out_dtype}: rel err {err:.2e} >= {tol}"


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}x{p[1]}")
def test_gemm_pair_matches_reference(pair):
    sa, sb = _operands(FORMATS[pair[0]], FORMATS[pair[1]])
    fp8_fp8 = pair[0].startswith("fp8") and pair[1].startswith("fp8") and "fp8_e4m3" in pair
    _check(sa, sb, f"A={pair[0]} B={pair[1]}", fp32_tol=5e-4 if fp8_fp8 else 1e-5)


@pytest.mark.parametrize("blocks", BLOCK_PAIRS, ids=lambda p: f"{p[0]}x{p[1]}")
def test_fp8_block_pairs_match_reference(blocks):
    qa, qb = (hd.Float8BlockQuantizer(block=b) for b in blocks)
    sa, sb = _operands(qa, qb)
    _check(sa, sb, f"fp8_block A={blocks[0]} B={blocks[1]}", fp32_tol=5e-4)


def test_nvfp4_shared_rht_multiplies_in_transformed_domain():
    """wgrad: dy.columnwise × x.columnwise, both RHT with the same seed."""
    q = hd.NVFP4Quantizer(rht=True)
    g = torch.Generator(device="cuda").manual_seed(3)
    dy = torch.randn(K, M, device="cuda", generator=g).bfloat16()  # logical [K(tokens), M]
    x = torch.randn(K, N, device="cuda", generator=g).bfloat16()
    sa = q.quantize_storages(dy, rowwise=False, columnwise=True)[1]
    sb = q.quantize_storages(x, rowwise=False, columnwise=True)[1]
    _check(sa, sb, "nvfp4 rht x nvfp4 rht")
    plain = hd.NVFP4Quantizer().quantize_storages(x, rowwise=False, columnwise=True)[1]
    _check(sa, plain, "nvfp4 rht x nvfp4 (unshared transform: reference)")


FOLDED = [("nvfp4", "nvfp4"), ("mxfp8", "nvfp4"), ("nvfp4", "mxfp8"), ("fp8_e4m3", "nvfp4"), ("nvfp4", "bf16"),
          ("mxfp8", "fp8_e5m2")]


@pytest.mark.parametrize("pair", FOLDED, ids=lambda p: f"{p[0]}x{p[1]}")
def test_bf16_output_folds_tensor_scales_within_bound(pair, monkeypatch):
    """``|out - ref| ≤ 2⁻⁸ (Σ|a·b| + |ref|)`` elementwise (one bf16 rounding per scaled
    operand value, one of the output; fp32 summation slack 1e-5 Σ|a·b|), and no fp32
    accumulator pass (``scale_cast``) runs."""
    from hybrid_dist.kernels import dequant

    monkeypatch.setattr(dequant, "scale_cast", lambda *a: pytest.fail("scale_cast ran for a bf16 output"))
    sa, sb = _operands(FORMATS[pair[0]], FORMATS[pair[1]])
    ref = reference_gemm_nt(sa, sb, out_dtype=torch.float32)
    out = gemm_nt(sa, sb, out_dtype=torch.bfloat16, config=GemmConfig())
    scale = 1.0
    for s in (sa.tensor_scale(), sb.tensor_scale()):
        scale = scale * (1.0 if s is None else float(s))
    abs_terms = (sa.values(undo_rht=False).abs() @ sb.values(undo_rht=False).abs().t()) * abs(scale)
    bound = 2.0**-8 * (abs_terms + ref.abs()) + 1e-5 * abs_terms
    excess = ((out.float() - ref).abs() - bound).max()
    assert excess <= 0, f"{pair}: error exceeds the folded-scale bound by {float(excess):.3e}"


def test_fp8_tensorwise_fast_accum_close():
    sa, sb = _operands(FORMATS["fp8_e4m3"], FORMATS["fp8_e4m3"])
    ref = reference_gemm_nt(sa, sb, out_dtype=torch.float32)
    out = gemm_nt(sa, sb, out_dtype=torch.bfloat16, config=GemmConfig(use_fast_accum=True))
    assert _rel(out, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_strided_operand_storage_matches_reference(fmt):
    """A storage whose fields are strided views (as saved or gathered fields can be) gives
    the reference's product: the dequantize kernels must not assume row-major buffers."""
    import hybrid_dist as hd
    from hybrid_dist import gemm

    q = hd.MXFP8Quantizer() if fmt == "mxfp8" else hd.NVFP4Quantizer()
    a = q.quantize(torch.randn(128, 256, device="cuda")).rowwise
    b = q.quantize(torch.randn(256, 256, device="cuda")).rowwise
    b = b.map_tensors(lambda t: t.t().contiguous().t() if t.dim() == 2 else t)  # column-major views
    out = gemm.gemm_nt(a, b, out_dtype=torch.float32, config=hd.GemmConfig())
    ref = gemm.reference_gemm_nt(a, b, out_dtype=torch.float32)
    assert ((out - ref).norm() / ref.norm()) < 1e-5
