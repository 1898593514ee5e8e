"""The arithmetic behind ``kernels._jit_common.div_by_rcp`` (the NVFP4 block scale's
``amax / 6``), checked exhaustively on the CPU with exact arithmetic.

``div_by_rcp(a, y, r)`` replaces the IEEE division ``RN(a / y)`` by ``q = RN(a·r)``,
``rem = RN(a - q·y)`` (an FMA), ``RN(q + rem·r)`` (an FMA), with ``r = RN(1/y)``. For
``y = 6`` this test runs those three fp32 operations on every fp32 significand in [1, 2)
(2**23 values; scaling ``a`` by a power of two scales every step exactly while the results
stay normal) and compares with ``RN(a / 6)``. numpy has no fp32 FMA, so each FMA is
evaluated exactly in float64 and rounded to fp32 once; where a float64 sum or quotient lands
exactly on an fp32 rounding midpoint (the only place a double rounding could differ), the
value is recomputed with ``fractions.Fraction``. The GPU test ``tests/kernels/test_jit_common.py``
runs the kernel helper itself on random ``(a, gs)`` pairs.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

RCP6 = np.array([0x3E2AAAAB], dtype=np.uint32).view(np.float32)[0]


def _on_fp32_midpoint(v64: np.ndarray) -> np.ndarray:
    """True where float64 ``v64`` is exactly halfway between two adjacent fp32 values."""
    bits = v64.view(np.uint64)
    return (bits & np.uint64((1 << 29) - 1)) == np.uint64(1 << 28)


def _rn32(v: Fraction) -> np.float32:
    """Exact round-to-nearest-even of a positive rational to fp32 (normal range)."""
    lo = np.float32(float(v))  # within an ulp; fix up with exact comparisons
    for _ in range(3):
        up = np.nextafter(lo, np.float32(np.inf))
        down = np.nextafter(lo, np.float32(0))
        if Fraction(float(up)) - v < v - Fraction(float(lo)) or (
                Fraction(float(up)) - v == v - Fraction(float(lo)) and int(up.view(np.uint32)) % 2 == 0):
            lo = up
        elif v - Fraction(float(down)) < Fraction(float(lo)) - v or (
                v - Fraction(float(down)) == Fraction(float(lo)) - v and int(down.view(np.uint32)) % 2 == 0):
            lo = down
        else:
            break
    return lo


def test_rcp6_is_the_rounded_reciprocal():
    assert RCP6 == np.float32(1.0) / np.float32(6.0)
    assert abs(Fraction(float(RCP6)) - Fraction(1, 6)) <= Fraction(float(np.spacing(RCP6))) / 2


def test_div_by_rcp_of_six_is_the_ieee_quotient_for_every_significand():
    a = (np.arange(1 << 23, dtype=np.uint32) | np.uint32(0x3F800000)).view(np.float32)  # [1, 2)
    a64, r64 = a.astype(np.float64), np.float64(RCP6)
    q = (a64 * r64).astype(np.float32)  # a·r is exact in float64: one rounding
    rem = (a64 - 6.0 * q.astype(np.float64)).astype(np.float32)  # exact in float64, then the FMA's rounding
    s64 = q.astype(np.float64) + rem.astype(np.float64) * r64  # the second FMA before its rounding
    got = s64.astype(np.float32)
    ref64 = a64 / 6.0
    ref = ref64.astype(np.float32)
    doubtful = np.flatnonzero(_on_fp32_midpoint(s64) | _on_fp32_midpoint(ref64))
    for i in doubtful:  # exact recomputation where a double rounding could matter
        fa, fq, fr = Fraction(float(a[i])), Fraction(float(q[i])), Fraction(float(RCP6))
        got[i] = _rn32(fq + Fraction(float(rem[i])) * fr)
        ref[i] = _rn32(fa / 6)
    bad = np.flatnonzero(got.view(np.uint32) != ref.view(np.uint32))
    assert bad.size == 0, f"{bad.size} significands differ, first a={a[bad[0]]!r}"
    assert np.array_equal(rem.astype(np.float64), a64 - 6.0 * q.astype(np.float64)), "remainder not exact"
