"""Bit-exact encodings of ``formats/numerics.py`` against hand-computed values.

E8M0 (MXFP8 block exponents, RCEIL), saturating FP8 casts, E2M1 codes (every grid point,
every tie under round-to-nearest-even, the sign bit), FP4 packing order, ``exp2_int``,
``pow2_floor`` and the 16×16 random Hadamard transform.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_dist.formats import numerics as N

# --- E8M0 ---------------------------------------------------------------------------

# (block amax, expected biased exponent e with 2**(e-127) >= amax/448, reason)
E8M0_CASES = [
    (448.0, 127, "amax/448 = 1 = 2**0 exactly: not rounded up"),
    (449.0, 128, "amax/448 just above 1: rounded up to 2**1"),
    (896.0, 128, "2**1 exactly"),
    (447.0, 127, "just below 2**0: ceil is 2**0"),
    (1.0, 119, "1/448 = 2**-8.8: ceil is 2**-8"),
    (448.0 * 2.0**-20, 107, "2**-20 exactly"),
    (448.0 * 2.0**-20 * 1.5, 108, "1.5 * 2**-20 rounds up to 2**-19"),
    (3.0e38, 247, "3e38/448 = 2**119.2: ceil is 2**120"),
    (448.0 * 2.0**-127, 0, "ratio 2**-127 (fp32 subnormal, exact): e = 0"),
    (448.0 * 2.0**-128, 0, "ratio 2**-128 < 2**-127: the smallest scale covers it"),
    (0.0, 0, "zero amax: e = 0 (every element quantizes to 0)"),
    (float("nan"), 255, "NaN amax: E8M0 NaN"),
    (float("inf"), 255, "Inf amax: E8M0 NaN"),
]


@pytest.mark.parametrize("amax,expected,why", E8M0_CASES, ids=[c[2] for c in E8M0_CASES])
def test_e8m0_from_amax_hand_values(amax, expected, why):
    e = N.e8m0_from_amax(torch.tensor([amax]), 448.0)
    assert e.dtype == torch.uint8
    assert int(e) == expected, f"{why}: amax={amax} gave e={int(e)}, expected {expected}"


def test_e8m0_scale_covers_amax_and_is_tight():
    # For every normal amax: amax/448 <= 2**(e-127) < 2 * amax/448 (RCEIL, never saturates).
    amax = torch.logspace(-30, 30, 2001, base=2.0, dtype=torch.float32)
    scale = N.e8m0_to_scale(N.e8m0_from_amax(amax, 448.0))
    ratio = amax / 448.0
    assert bool((scale >= ratio).all())
    assert bool((scale < 2 * ratio).all())


def test_e8m0_decode_and_inverse_are_exact_powers_of_two():
    e = torch.arange(0, 255, dtype=torch.int32).to(torch.uint8)
    k = torch.arange(0, 255, dtype=torch.float64) - 127
    assert torch.equal(N.e8m0_to_scale(e).double(), torch.pow(2.0, k))
    assert torch.equal(N.e8m0_to_inv_scale(e).double(), torch.pow(2.0, -k))


def test_exp2_int_normal_and_subnormal():
    k = torch.tensor([-149, -140, -127, -126, -1, 0, 1, 127])
    assert torch.equal(N.exp2_int(k).double(), torch.pow(2.0, k.double()))


def test_pow2_floor_rounds_down():
    x = torch.tensor([3.0, 4.0, 0.7, 448.0, 1.0e-3, 5.0e30])
    expected = torch.tensor([2.0, 4.0, 0.5, 256.0, 2.0**-10, 2.0**101])
    assert torch.equal(N.pow2_floor(x), expected)


# --- FP8 saturating casts ---------------------------------------------------------------

@pytest.mark.parametrize("dtype,fmax", [(torch.float8_e4m3fn, 448.0), (torch.float8_e5m2, 57344.0)])
def test_cast_to_fp8_saturates_instead_of_nan(dtype, fmax):
    x = torch.tensor([1e6, -1e6, fmax * 1.2, -fmax * 1.2, float("inf"), -float("inf"), fmax, 1.0])
    y = N.cast_to_fp8(x, dtype)
    assert y.dtype == dtype
    expected = torch.tensor([fmax, -fmax, fmax, -fmax, fmax, -fmax, fmax, 1.0])
    assert torch.equal(y.float(), expected)
    assert not bool(torch.isnan(y.float()).any())


def test_cast_to_fp8_rounds_to_nearest_even():
    # E4M3 around 1: step 1/8. 1 + 1/16 is a tie -> even mantissa (1.0); 1 + 3/16 -> 1.25.
    x = torch.tensor([1.0625, 1.1875, 1.07, 17.0, 19.0])
    # Around 16 the step is 2: 17 is a tie -> 16 (even), 19 a tie -> 20 (even).
    assert N.cast_to_fp8(x, torch.float8_e4m3fn).float().tolist() == [1.0, 1.25, 1.125, 16.0, 20.0]


# --- E2M1 -------------------------------------------------------------------------------

def test_e2m1_every_grid_point_encodes_to_its_code():
    grid = torch.tensor(N.E2M1_GRID)
    codes = N.e2m1_encode(grid)
    assert codes.tolist() == list(range(8))
    assert torch.equal(N.e2m1_decode(codes), grid)
    neg = N.e2m1_encode(-grid[1:])
    assert neg.tolist() == [8 | c for c in range(1, 8)], "sign is bit 3"
    assert torch.equal(N.e2m1_decode(neg), -grid[1:])


# Every midpoint between neighbours, with the round-to-nearest-even result.
E2M1_TIES = [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0)]


@pytest.mark.parametrize("tie,expected", E2M1_TIES, ids=[f"{t}->{e}" for t, e in E2M1_TIES])
def test_e2m1_ties_round_to_nearest_even(tie, expected):
    for sign in (1.0, -1.0):
        code = N.e2m1_encode(torch.tensor([sign * tie]))
        assert float(N.e2m1_decode(code)) == sign * expected  # (-0.0 == 0.0)
        assert int(code) & 0x7 == N.E2M1_GRID.index(expected)
        # even code = mantissa bit 0 clear
        assert (int(code) & 0x1) == 0


def test_e2m1_non_ties_and_saturation():
    v = torch.tensor([0.24, 0.26, 0.74, 0.76, 1.3, 2.4, 2.6, 3.4, 3.6, 4.9, 5.1, 6.0, 7.0, 100.0])
    expected = [0.0, 0.5, 0.5, 1.0, 1.5, 2.0, 3.0, 3.0, 4.0, 4.0, 6.0, 6.0, 6.0, 6.0]
    assert N.e2m1_decode(N.e2m1_encode(v)).tolist() == expected
    assert N.e2m1_decode(N.e2m1_encode(-v)).tolist() == [-e for e in expected]


def test_e2m1_sign_nibble_of_small_negatives():
    # A negative value that rounds to zero keeps its sign bit (-0), like the hardware cast.
    codes = N.e2m1_encode(torch.tensor([0.0, -0.1, 0.1]))
    assert codes.tolist() == [0x0, 0x8, 0x0]
    # -0.0 too (its sign bit, as an IEEE conversion; the kernels read it from the input's bits),
    # with either rounding
    v = torch.tensor([-0.0, 0.0, -1e-30, -6.0])
    assert N.e2m1_encode(v).tolist() == [0x8, 0x0, 0x8, 0xF]
    assert N.e2m1_encode(v, torch.full((4,), 0.5)).tolist() == [0x8, 0x0, 0x8, 0xF]


def test_pack_fp4_element_2j_in_low_nibble():
    codes = torch.tensor([[0x1, 0x2, 0xF, 0x0, 0x7, 0x9]], dtype=torch.uint8)
    packed = N.pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0x0F, 0x97]]
    assert torch.equal(N.unpack_fp4(packed), codes)


def test_pack_unpack_round_trip_all_bytes():
    all_bytes = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(4, 64)
    assert torch.equal(N.pack_fp4(N.unpack_fp4(all_bytes)), all_bytes)


# --- stochastic E2M1 --------------------------------------------------------------------

def test_e2m1_stochastic_rounds_between_neighbours_with_the_right_probability():
    # 2.4 lies between 2 and 3: rounds up with probability 0.4.
    n = 20000
    rand = torch.rand(n, generator=torch.Generator().manual_seed(0))
    vals = N.e2m1_decode(N.e2m1_encode(torch.full((n,), 2.4), rand))
    assert set(vals.unique().tolist()) == {2.0, 3.0}
    p_up = float((vals == 3.0).float().mean())
    assert abs(p_up - 0.4) < 0.02, p_up  # binomial std = 0.0035
    # grid points never move; 6 and above saturate at 6
    exact = torch.tensor(N.E2M1_GRID + (7.0,))
    out = N.e2m1_decode(N.e2m1_encode(exact, torch.full_like(exact, 0.999)))
    assert out.tolist() == list(N.E2M1_GRID) + [6.0]


# --- random Hadamard transform ----------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 1234])
def test_hadamard16_is_orthogonal(seed):
    t = N.hadamard16(seed)
    assert t.shape == (16, 16) and t.dtype == torch.float32
    assert torch.allclose(t @ t.t(), torch.eye(16), atol=1e-6, rtol=0)
    assert torch.allclose(t.t() @ t, torch.eye(16), atol=1e-6, rtol=0)
    assert set(t.abs().unique().tolist()) == {0.25}, "entries are ±1/4"


def test_hadamard16_seeds_give_different_sign_vectors():
    assert not torch.equal(N.hadamard16(0), N.hadamard16(1))
    assert torch.equal(N.hadamard16(7), N.hadamard16(7))


def test_apply_hadamard16_inverse_recovers_input_and_preserves_dots():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=g)
    w = torch.randn(4, 64, generator=g)
    t = N.hadamard16(3)
    y = N.apply_hadamard16(x, t)
    assert not torch.allclose(y, x)
    assert torch.allclose(N.apply_hadamard16(y, t, inverse=True), x, atol=1e-5, rtol=0)
    # the transform is per 16-chunk of the last dim and preserves dot products along it
    assert torch.allclose(y @ N.apply_hadamard16(w, t).t(), x @ w.t(), atol=1e-4, rtol=1e-5)
    assert torch.allclose(y[:, :16], x[:, :16] @ t.t(), atol=1e-6, rtol=0)


def test_e2m1_encode_matches_a_brute_force_nearest_even_reference():
    # 200k random magnitudes in [0, 7) plus every tie: nearest grid point, ties to the even code
    g = torch.Generator().manual_seed(0)
    v = torch.cat([torch.rand(200_000, generator=g) * 7, torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])])
    v = torch.cat([v, -v])
    grid = torch.tensor(N.E2M1_GRID, dtype=torch.float64)
    dist = (v.double().abs().clamp(max=6.0)[:, None] - grid[None, :]).abs()
    best = dist.min(1, keepdim=True).values
    candidates = dist == best  # one code, or two at a tie
    codes = torch.arange(8)[None, :].expand_as(candidates)
    even = torch.where(candidates & (codes % 2 == 0), codes, 99).min(1).values
    expected_mag = torch.where(candidates.sum(1) > 1, even, dist.argmin(1))
    got = N.e2m1_encode(v)
    assert torch.equal((got & 0x7).long(), expected_mag)
    assert torch.equal((got >> 3).bool(), v < 0)


def test_e2m1_stochastic_encode_is_the_grid_definition():
    """Same rand: the SR encode (grid points chosen from scalar thresholds, no host-built
    tensor) is bitwise the definition — ``lo = bucketize(|v|, grid, right) - 1`` clamped
    to 6, up with probability ``(|v| - grid[lo]) / (grid[lo+1] - grid[lo])`` — at grid
    points, ties and the clamp at 6 included."""
    torch.manual_seed(0)
    v = torch.cat([torch.linspace(-6.5, 6.5, 2001), torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -6.0])])
    rand = torch.rand(v.shape)
    grid = torch.tensor(N.E2M1_GRID)
    mag = v.abs().clamp(max=N.E2M1_MAX)
    lo = (torch.bucketize(mag, grid, right=True) - 1).clamp(0, 6)
    p_up = (mag - grid[lo]) / (grid[lo + 1] - grid[lo])
    want = (lo + (rand < p_up).long()).to(torch.uint8) | ((v < 0).to(torch.uint8) << 3)
    assert torch.equal(N.e2m1_encode(v, rand), want)


def test_assume_constant_result_marks_like_torchs_decorator_and_import_skips_dynamo():
    import subprocess
    import sys

    import torch._dynamo

    ours, theirs = N._assume_constant_result(lambda: 0), torch._dynamo.assume_constant_result(lambda: 0)
    assert vars(ours) == vars(theirs) == {"_dynamo_marked_constant": True}
    code = "import sys, hybrid_dist; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False", "importing hybrid_dist imported torch._dynamo (seconds per process)"


def test_hadamard16_inside_a_default_device_block():
    """A model built under ``with torch.device(...)`` (here meta) with NVFP4 RHT quantizers:
    the matrix is still made on the CPU from its seed, the same as outside the block."""
    from hybrid_dist.formats.numerics import _hadamard16_cpu

    want = _hadamard16_cpu(11).clone()
    _hadamard16_cpu.cache_clear()
    with torch.device("meta"):
        got = _hadamard16_cpu(11)
    assert got.device.type == "cpu" and torch.equal(got, want)
    assert torch.equal(got @ got.T, torch.eye(16))
