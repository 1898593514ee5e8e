"""``tests/_nvfp4_sr_stream.py``, the torch model of the NVFP4 kernels' stochastic-rounding
stream, is itself right: its Philox4x32-10 reproduces the Random123 known-answer vectors, and
(with Triton installed) ``tl.randint4x`` under the interpreter for 64-bit seeds."""

from __future__ import annotations

import torch

from tests._helpers import run_under_triton_interpreter
from tests._nvfp4_sr_stream import kernel_sr_rand, noise_rand, philox4x32_10, randint4x

KAT = [  # (counter, key, output): Random123 kat_vectors, philox4x32 with 10 rounds
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def test_philox_known_answers():
    for ctr, key, want in KAT:
        got = philox4x32_10(*(torch.tensor([c], dtype=torch.int64) for c in ctr), *key)
        assert tuple(int(g) for g in got) == want, (ctr, key, [hex(int(g)) for g in got])


def test_kernel_rand_layout():
    """Rowwise and columnwise draws are different counters; each 16-row group shares one
    call per column, its rows taking distinct bytes; values are the 256 cell edges."""
    row, col = kernel_sr_rand(9, 32, 8, False), kernel_sr_rand(9, 32, 8, True)
    assert row.shape == (32, 8) and col.shape == (8, 32)
    assert not torch.equal(row, col.t())
    assert torch.isin(row, noise_rand(torch.arange(256))).all()
    w = randint4x(9, torch.tensor([0], dtype=torch.int64))  # group 0, column 0: rows 0..15
    r8 = torch.tensor([(int(w[j // 4]) >> (8 * (j % 4))) & 0xFF for j in range(16)])
    assert torch.equal(row[:16, 0], noise_rand(r8))
    assert (noise_rand(r8) < 1.0 - (r8 + 0.5) / 256).all() and (noise_rand(r8) > 1.0 - (r8 + 0.6) / 256).all()


def _check_randint4x_matches_triton():
    import triton
    import triton.language as tl

    @triton.jit
    def draw(out, seed, N: tl.constexpr):
        c = tl.arange(0, N).to(tl.uint32) * 977 + 4000000000  # wraps past 2**32
        a, b, c2, d = tl.randint4x(seed, c)
        tl.store(out + tl.arange(0, N), a)
        tl.store(out + N + tl.arange(0, N), b)
        tl.store(out + 2 * N + tl.arange(0, N), c2)
        tl.store(out + 3 * N + tl.arange(0, N), d)

    for seed in (0, 12345, (3 << 32) + 7):
        out = torch.zeros(4 * 64, dtype=torch.int32)
        draw[(1,)](out, seed, N=64)
        ctr = (torch.arange(64, dtype=torch.int64) * 977 + 4000000000) & 0xFFFFFFFF
        assert torch.equal(out.to(torch.int64) & 0xFFFFFFFF, torch.cat(randint4x(seed, ctr))), seed


def test_randint4x_matches_triton_interpreter():
    run_under_triton_interpreter("from tests.test_nvfp4_sr_stream_model import _check_randint4x_matches_triton as c; "
                                 "c(); print('randint4x ok')", done="randint4x ok", timeout=300)
