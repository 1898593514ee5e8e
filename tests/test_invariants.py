"""docs/design.md §4 invariants 1–3 on the reference backend, for every format and ordered pair.

1. Same format both ways is free: Hybrid(F, F) == plain F, bitwise (outputs and grads).
2. Cross-format is exact per direction: Hybrid(A, B) inputs/weights with plain-B grads give
   plain-A's output and plain-B's input/weight gradients, bitwise.
3. Any pair meets in one GEMM: the mixed product equals the fp64 product of the two
   dequantized operands to fp32 accumulation accuracy, and tracks the unquantized product
   within the coarser format's SQNR.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import hybrid_dist as hd
from hybrid_dist import gemm
from tests._helpers import assert_bitwise_equal, sqnr_db

FORMATS = {
    "fp8": hd.Float8Quantizer(),
    "fp8_block": hd.Float8BlockQuantizer(block="1x128"),
    "mxfp8": hd.MXFP8Quantizer(),
    "nvfp4": hd.NVFP4Quantizer(rht=True),
    "identity": hd.IdentityQuantizer(),
}
# Extra single-format variants for invariant 1 (stateful and 2D-block configurations).
SAME_FORMAT_EXTRA = {
    "fp8_e5m2_pow2": hd.Float8Quantizer(dtype=torch.float8_e5m2, power_of_2_scales=True),
    "fp8_delayed": hd.Float8Quantizer(scaling="delayed"),
    "fp8_block_128x128": hd.Float8BlockQuantizer(block="128x128"),
    "nvfp4_2d_sr": hd.NVFP4Quantizer(block_2d=True, stochastic_rounding=True),
}
# SQNR (dB) a GEMM operand in each format keeps on Gaussian data (measured ~31 for the
# 8-bit formats and ~20 for NVFP4 RTN; bounds leave margin).
MIN_SQNR = {"fp8": 25.0, "fp8_block": 25.0, "mxfp8": 25.0, "nvfp4": 14.0, "identity": 100.0}

M, K, N = 128, 256, 128


def _run_linear(factory, seed: int = 0):
    """One Linear fwd+bwd with a fixed upstream gradient; returns (y, dx, dW)."""
    torch.manual_seed(seed)
    x = torch.randn(M, K, requires_grad=True)
    lin = hd.Linear(K, N, bias=False, recipe=hd.CustomRecipe(factory))
    g = torch.randn(M, N)
    torch.manual_seed(1234)  # stochastic rounding on the global stream starts equal
    y = lin(x)
    y.backward(g)
    return y.detach(), x.grad, lin.weight.grad


@pytest.mark.parametrize("name", list(FORMATS) + list(SAME_FORMAT_EXTRA))
def test_same_format_hybrid_is_bitwise_plain(name):
    f = {**FORMATS, **SAME_FORMAT_EXTRA}[name]
    plain = _run_linear(lambda role: f)
    hybrid = _run_linear(lambda role: hd.HybridQuantizer(rowwise=f, columnwise=f))
    for what, a, b in zip(("y", "dx", "dW"), plain, hybrid):
        assert_bitwise_equal(a, b, f"{name}: {what}")


PAIRS = [(a, b) for a, b in itertools.permutations(FORMATS, 2)]


@pytest.mark.parametrize("row,col", PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_cross_format_exact_per_direction(row, col):
    a, b = FORMATS[row], FORMATS[col]
    h = hd.HybridQuantizer(rowwise=a, columnwise=b)
    y_h, dx_h, dw_h = _run_linear(lambda role: b if role.tensor_type == "grad_output" else h)
    y_a, _, _ = _run_linear(lambda role: a)
    _, dx_b, dw_b = _run_linear(lambda role: b)
    assert_bitwise_equal(y_h, y_a, f"hybrid({row},{col}) output vs plain {row}")
    assert_bitwise_equal(dx_h, dx_b, f"hybrid({row},{col}) dx vs plain {col}")
    assert_bitwise_equal(dw_h, dw_b, f"hybrid({row},{col}) dW vs plain {col}")


ALL_PAIRS = list(itertools.product(FORMATS, repeat=2))


@pytest.mark.parametrize("fa,fb", ALL_PAIRS, ids=[f"{a}x{b}" for a, b in ALL_PAIRS])
@pytest.mark.parametrize("direction", ["rowwise", "columnwise"])
def test_mixed_pair_gemm_matches_fp64(fa, fb, direction):
    torch.manual_seed(0)
    a_hp, b_hp = torch.randn(M, K), torch.randn(N, K)
    if direction == "columnwise":  # contract over dim 0: operands are [K, M] and [K, N]
        a_hp, b_hp = a_hp.t().contiguous(), b_hp.t().contiguous()
    qa = FORMATS[fa].quantize(a_hp, rowwise=direction == "rowwise", columnwise=direction == "columnwise")
    qb = FORMATS[fb].quantize(b_hp, rowwise=direction == "rowwise", columnwise=direction == "columnwise")
    sa, sb = qa.storage_of(direction), qb.storage_of(direction)
    out = gemm.gemm_nt(sa, sb, out_dtype=torch.float32, config=hd.GemmConfig())
    # fp64 product of the dequantized operands, laid out as the stored (contraction-last) forms
    da = qa.dequantize(direction, torch.float64)
    db = qb.dequantize(direction, torch.float64)
    ref = da @ db.t() if direction == "rowwise" else da.t() @ db
    assert out.shape == ref.shape
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err < 1e-5, f"{fa}x{fb} {direction}: max rel error {err:.2e} vs fp64 of dequantized operands"
    exact = a_hp.double() @ b_hp.double().t() if direction == "rowwise" else a_hp.double().t() @ b_hp.double()
    bound = min(MIN_SQNR[fa], MIN_SQNR[fb]) - 3.0
    assert sqnr_db(exact, out) > bound, f"{fa}x{fb} {direction}: SQNR {sqnr_db(exact, out):.1f} dB <= {bound}"


def test_rht_pair_multiplies_in_transformed_domain():
    """Two RHT operands with the same seed are multiplied without undoing the transform,
    and give the same product as undoing it (T is orthogonal) up to fp32 rounding."""
    q = hd.NVFP4Quantizer(rht=True)
    a, b = torch.randn(K, M), torch.randn(K, N)  # wgrad operands: contract over K rows
    sa = q.quantize(a.t().contiguous().t(), rowwise=False, columnwise=True).columnwise
    sb = q.quantize(b.t().contiguous().t(), rowwise=False, columnwise=True).columnwise
    fast = gemm.reference_gemm_nt(sa, sb, out_dtype=torch.float64)
    slow = (sa.values().double() @ sb.values().double().t()) * sa.global_scale.double() * sb.global_scale.double()
    assert ((fast - slow).abs().max() / slow.abs().max()) < 1e-5
