"""The arithmetic of ``kernels.nvfp4._e2m1``'s PTX E2M1 encoder, emulated with torch fp32 ops
(IEEE round to nearest, subnormals kept), equals ``numerics.e2m1_encode``.

The encoder rounds on the FMA pipe: ``u = min(|v|, 6)``, ``m = 1.5 · 2**(22+E)`` with
``E = max(floor(log2 u), 0)`` (the exponent bits of ``max(u, 1)``), ``r = (u + m) - m``,
code ``= bits(r · 2**-126) >> 22``. Checked here on every fp32 bit pattern within 2**12 ulps
of each E2M1 grid point and rounding threshold, and on random values; the same emulation
matched on every fp32 in (-8, 8) (2**31 patterns, run once by hand). The GPU test of the
NVFP4 kernels checks the PTX itself bitwise (``tests/kernels/nvfp4/``).

The stochastic encoder (``e2m1_sr_mad``) adds ``gap · n`` (``n = (r8 + 1/2) / 256``) with an
``fma.rz`` and truncates with the magic add in round-toward-zero; emulated in float64 (exact
for these operands: the sums span fewer than 53 bits wherever the result depends on them),
then truncated to fp32, it equals ``e2m1_encode(v, rand)`` for ``rand`` just below ``1 - n``,
for every ``r8``.
"""

from __future__ import annotations

import torch

from hybrid_dist.formats.numerics import e2m1_encode
from tests._nvfp4_sr_stream import noise_rand

GRID_AND_TIES = [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0]


def _magic_encode(v: torch.Tensor) -> torch.Tensor:
    u = torch.minimum(v.abs(), torch.tensor(6.0))
    e = torch.maximum(u, torch.tensor(1.0))
    m = (e.view(torch.int32) & 0x7F800000).view(torch.float32) * 6291456.0  # 1.5 * 2**22 * 2**E
    r = (u + m) - m
    code = (r * 2.0**-126).view(torch.int32) >> 22
    return code | (torch.signbit(v).to(torch.int32) << 3)


def _near_thresholds(ulps: int = 2**12) -> torch.Tensor:
    bits = torch.tensor(GRID_AND_TIES, dtype=torch.float32).view(torch.int32)
    pats = (bits[:, None] + torch.arange(-ulps, ulps + 1, dtype=torch.int32)[None, :]).reshape(-1)
    pats = pats[pats >= 0]
    v = pats.view(torch.float32)
    return torch.cat([v, -v])


def test_magic_rounding_equals_the_reference_encoder():
    torch.set_flush_denormal(False)  # the default; the PTX multiplies without .ftz
    gen = torch.Generator().manual_seed(0)
    n = 2**20
    rand = (torch.rand(n, generator=gen) * 16 - 8) * torch.exp2(torch.randint(-30, 1, (n,), generator=gen).float())
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-45, -1e-45, 6.0001, 1e30])
    for what, v in (("near thresholds", _near_thresholds()), ("random", rand), ("special", special)):
        ref = e2m1_encode(v).to(torch.int32)
        got = _magic_encode(v)
        bad = (ref != got).nonzero()
        assert bad.numel() == 0, (f"{what}: {bad.numel()} codes differ, first v={v[bad[0]].item()!r} "
                                  f"ref={ref[bad[0]].item()} got={got[bad[0]].item()}")


def _rz32(y: torch.Tensor) -> torch.Tensor:
    """float64 ``y >= 0`` → fp32, rounded toward zero."""
    f = y.float()
    return torch.where(f.double() > y, torch.nextafter(f, torch.tensor(0.0)), f)


def _sr_encode(v: torch.Tensor, r8: torch.Tensor) -> torch.Tensor:
    """The PTX of ``_e2m1._SR_CODE`` step by step (fp32 values, float64 for the ``.rz`` ops)."""
    noise = ((r8.to(torch.int32) << 8) | 0x42800080).view(torch.float32)  # sr_noise's prmt
    u = torch.minimum(v.abs(), torch.tensor(6.0))
    e = (torch.maximum(u, torch.tensor(1.0)).view(torch.int32) & 0x7F800000).view(torch.float32)
    m = e * 6291456.0
    t = noise - 64.0
    s = _rz32(e.double() * t.double() + u.double())
    r = _rz32(s.double() + m.double()) - m
    code = (r * 2.0**-126).view(torch.int32) >> 22
    return code | (torch.signbit(v).to(torch.int32) << 3)


def _sr_thresholds(ulps: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(v, r8)`` pairs within ``ulps`` of where the code with noise byte ``r8`` (or its
    neighbours) turns up: ``lo + gap · (1 - n)`` for every grid interval."""
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    lo = torch.tensor(grid[:-1])[:, None]
    gap = torch.tensor(grid[1:])[:, None] - lo
    r8 = torch.arange(256)[None, :]
    thr = (lo + gap * (1 - (r8 + 0.5) / 256)).reshape(-1)  # exact: at most 10 significant bits
    pats = thr.view(torch.int32)[:, None] + torch.arange(-ulps, ulps + 1, dtype=torch.int32)[None, :]
    v = pats.view(torch.float32)[:, :, None].expand(-1, -1, 3)
    r8 = (r8.expand(lo.shape[0], -1).reshape(-1)[:, None, None] + torch.tensor([-1, 0, 1])).clamp(0, 255)
    v, r8 = v.reshape(-1), r8.expand(-1, 2 * ulps + 1, -1).reshape(-1)
    return torch.cat([v, -v]), torch.cat([r8, r8])


def _all_bytes(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return v[:, None].expand(-1, 256).reshape(-1), torch.arange(256).repeat(v.numel())


def test_stochastic_encoder_equals_the_reference_with_the_kernel_noise():
    gen = torch.Generator().manual_seed(1)
    n = 2**13
    rand = (torch.rand(n, generator=gen) * 16 - 8) * torch.exp2(torch.randint(-30, 1, (n,), generator=gen).float())
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-45, -1e-45, 6.0001, 1e30, -6.0])
    cases = {"near SR thresholds": _sr_thresholds(), "near grid and RNE thresholds": _all_bytes(_near_thresholds(16)),
             "random": _all_bytes(rand), "special": _all_bytes(special)}
    for what, (v, r8) in cases.items():
        ref = e2m1_encode(v, noise_rand(r8)).to(torch.int32)
        got = _sr_encode(v, r8)
        bad = (ref != got).nonzero()
        assert bad.numel() == 0, (f"{what}: {bad.shape[0]} codes differ, first v={v[bad[0]].item()!r} "
                                  f"r8={r8[bad[0]].item()} ref={ref[bad[0]].item()} got={got[bad[0]].item()}")
    # the probability of rounding up is (u - lo) / gap to the nearest 1/256, halves up
    u = torch.tensor([1.0 + 0.5 * p / 1024 for p in range(0, 1024, 7)])
    v, r8 = _all_bytes(u)
    ups = (_sr_encode(v, r8) == 3).reshape(-1, 256).sum(1)
    assert torch.equal(ups, torch.floor((u - 1.0) / 0.5 * 256 + 0.5).long()), ups
