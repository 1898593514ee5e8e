"""The arithmetic of ``kernels._e2m1``'s PTX E2M1 encoder, emulated with torch fp32 ops
(IEEE round to nearest, subnormals kept), equals ``_numerics.e2m1_encode``.

The encoder rounds on the FMA pipe: ``u = min(|v|, 6)``, ``m = 1.5 · 2**(22+E)`` with
``E = max(floor(log2 u), 0)`` (the exponent bits of ``max(u, 1)``), ``r = (u + m) - m``,
code ``= bits(r · 2**-126) >> 22``. Checked here on every fp32 bit pattern within 2**12 ulps
of each E2M1 grid point and rounding threshold, and on random values; the same emulation
matched on every fp32 in (-8, 8) (2**31 patterns, run once by hand). The GPU test of the
NVFP4 kernels checks the PTX itself bitwise (``tests/gpu/test_quantize_kernels.py``).
"""

from __future__ import annotations

import torch

from hybrid_dist.formats._numerics import e2m1_encode

GRID_AND_TIES = [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0]


def _magic_encode(v: torch.Tensor) -> torch.Tensor:
    u = torch.minimum(v.abs(), torch.tensor(6.0))
    e = torch.maximum(u, torch.tensor(1.0))
    m = (e.view(torch.int32) & 0x7F800000).view(torch.float32) * 6291456.0  # 1.5 * 2**22 * 2**E
    r = (u + m) - m
    code = (r * 2.0**-126).view(torch.int32) >> 22
    return code | ((v < 0).to(torch.int32) << 3)


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
