"""Quantize -> dequantize SQNR of every format and option, per direction, on a Gaussian
``[256, 256]`` input (seed 0).

Each bound is the measured value minus a margin (~1.5 dB), and each format also has an
upper bound (measured + 3 dB) so that a format silently falling back to higher precision
fails too. The values are set by the element format: E4M3 keeps 3 mantissa bits (~31.5 dB
on a Gaussian), E5M2 2 bits (~25.5 dB), E2M1 1 bit with 16-element scales (~20.4 dB).
"""

from __future__ import annotations

import pytest
import torch

from hybrid_dist.formats import (
    Float8BlockQuantizer,
    Float8Quantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)
from tests._helpers import sqnr_db

E5M2 = torch.float8_e5m2

# id -> (quantizer, measured dB (rowwise, columnwise), lower bound)
CASES = {
    "fp8_e4m3_current": (Float8Quantizer(), (31.5, 31.5), 30.0),
    "fp8_e5m2_current": (Float8Quantizer(dtype=E5M2), (25.6, 25.6), 24.0),
    "fp8_e4m3_pow2_eps": (Float8Quantizer(power_of_2_scales=True, amax_epsilon=1e-6), (31.5, 31.5), 30.0),
    "fp8_e4m3_delayed": (Float8Quantizer(scaling="delayed"), (31.5, 31.5), 30.0),
    "fp8_e5m2_delayed": (Float8Quantizer(scaling="delayed", dtype=E5M2), (25.6, 25.6), 24.0),
    "fp8_block_1x128": (Float8BlockQuantizer(), (31.5, 31.5), 30.0),
    "fp8_block_128x128": (Float8BlockQuantizer(block="128x128"), (31.5, 31.5), 30.0),
    "fp8_block_1x128_e5m2": (Float8BlockQuantizer(dtype=E5M2), (25.5, 25.5), 24.0),
    "fp8_block_1x128_exact_scales": (Float8BlockQuantizer(power_of_2_scales=False), (31.8, 31.8), 30.0),
    "mxfp8": (MXFP8Quantizer(), (31.5, 31.5), 30.0),
    "mxfp8_e5m2": (MXFP8Quantizer(dtype=E5M2), (25.5, 25.5), 24.0),
    "nvfp4": (NVFP4Quantizer(), (20.4, 20.4), 19.0),
    "nvfp4_rht": (NVFP4Quantizer(rht=True), (20.4, 20.45), 19.0),
    "nvfp4_sr": (NVFP4Quantizer(stochastic_rounding=True), (16.9, 17.2), 15.5),
    "nvfp4_2d": (NVFP4Quantizer(block_2d=True), (19.1, 19.1), 17.5),
    "nvfp4_rht_sr": (NVFP4Quantizer(rht=True, stochastic_rounding=True), (16.9, 17.3), 15.5),
    "nvfp4_rht_2d": (NVFP4Quantizer(rht=True, block_2d=True), (19.1, 19.0), 17.5),
    "nvfp4_sr_2d": (NVFP4Quantizer(stochastic_rounding=True, block_2d=True), (16.0, 16.0), 14.5),
    "nvfp4_rht_sr_2d": (NVFP4Quantizer(rht=True, stochastic_rounding=True, block_2d=True), (16.0, 16.0), 14.5),
    "identity_bf16": (IdentityQuantizer(dtype=torch.bfloat16), (55.6, 55.6), 54.0),
}


@pytest.fixture(scope="module")
def x():
    return torch.randn(256, 256, generator=torch.Generator().manual_seed(0))


def _prime(q, x):
    """A state whose delayed scale was computed from ``x``'s amax (one finished pass)."""
    st = q.make_state()
    if isinstance(q, Float8Quantizer) and q.scaling == "delayed":
        q.quantize(x, state=st)
        q.advance_state(st)
    return st


@pytest.mark.parametrize("direction", ["rowwise", "columnwise"])
@pytest.mark.parametrize("name", list(CASES))
def test_sqnr_bounds(name, direction, x):
    q, measured, bound = CASES[name]
    t = q.quantize(x, rowwise=direction == "rowwise", columnwise=direction == "columnwise", state=_prime(q, x))
    db = sqnr_db(x, t.dequantize(direction))
    expected = measured[direction == "columnwise"]
    assert db > bound, f"{name} {direction}: SQNR {db:.2f} dB <= bound {bound} (measured {expected})"
    assert db < expected + 3.0, f"{name} {direction}: SQNR {db:.2f} dB suspiciously high (expected ~{expected})"


def test_identity_is_lossless(x):
    t = IdentityQuantizer().quantize(x)
    assert torch.equal(t.dequantize("rowwise"), x) and torch.equal(t.dequantize("columnwise"), x)


@pytest.mark.parametrize("name", ["fp8_e4m3_current", "mxfp8", "nvfp4", "fp8_block_1x128"])
def test_bf16_input_keeps_its_dtype_and_sqnr(name, x):
    q, measured, bound = CASES[name]
    xb = x.to(torch.bfloat16)
    t = q.quantize(xb)
    assert t.dtype == torch.bfloat16 and t.dequantize().dtype == torch.bfloat16
    assert sqnr_db(xb.float(), t.dequantize().float()) > bound - 0.5  # + bf16 output rounding


def test_delayed_first_pass_scale_one_loses_small_values(x):
    # the first pass of delayed scaling uses scale 1: a Gaussian * 1e-3 mostly underflows
    q = Float8Quantizer(scaling="delayed")
    small = x * 1e-3
    first = sqnr_db(small, q.quantize(small, state=q.make_state()).dequantize())
    primed = sqnr_db(small, q.quantize(small, state=_prime(q, small)).dequantize())
    assert first < 15.0 and primed > 30.0, (first, primed)
