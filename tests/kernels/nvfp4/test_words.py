"""``kernels.nvfp4.words`` (1×16 blocks from bf16 words) against the tile kernel: bitwise,
with RHT and stochastic rounding of one direction, on the GPU at every tile config and under
the Triton interpreter (CPU, the slow tier); the lane-quad row scales only at the configs
whose layout they assume (host side).
"""

from __future__ import annotations

import pytest
import torch

from tests._helpers import run_check_under_triton_interpreter
from tests._tiers import slow

from hybrid_dist.kernels.nvfp4.configs import (NVFP4_SWEEP, NVFP4_WORDS_BOTH, NVFP4_WORDS_DEFAULT,
                                              NVFP4_WORDS_RHT_DEFAULT)
from hybrid_dist.kernels.tile_config import TileConfig
from tests.kernels._quantize_checks import DIRS, bits_equal, make_x


@pytest.mark.gpu
@pytest.mark.parametrize("sr", [False, True], ids=["rne", "sr"])
@pytest.mark.parametrize("cfg", NVFP4_SWEEP, ids=lambda c: c.label())
def test_nvfp4_rht_words_kernel_bitwise_tile_kernel(cfg, sr):
    """1×16 blocks with RHT from bf16 take the words kernel: bitwise the tile kernel (the same
    fp32 transform, block scales and codes), every direction set, at every tile config and
    the tile kernel's default, with partial tiles along M and K (96x160), +-inf, bf16
    subnormals and tiny normals (the tile kernel's products ``x/4`` subnormal: the words
    kernel's unscaled butterflies, ``kernels.nvfp4._rht_words``, are exact there too). ``sr``:
    stochastic rounding (the tile kernel's Philox stream, a key with a non-zero high word) of
    one direction: columnwise with RHT, rowwise with and without (``nvfp4.words``' note "SR")."""
    from hybrid_dist.kernels.nvfp4.quantize import _rht_row, nvfp4_amax_tiles, nvfp4_quantize_tiles

    seed = torch.tensor([(5 << 32) + 77 if sr else 0], dtype=torch.int64, device="cuda")
    cases = [(True, False, False), (True, False, True), (False, True, True)] if sr else [
        (rw, cw, True) for rw, cw in DIRS]
    for shape in ((384, 640), (96, 160)):
        for x in (make_x(shape), make_x(shape, seed=1)):
            if shape == (96, 160):
                x[37, 5], x[70, 90] = float("inf"), float("-inf")
                x[:16, :8] *= 2.0**-120
                x[16:32, 8:16] = 2.0**-133 * torch.randint(-3, 4, (16, 8), device="cuda")
            t = _rht_row(3, x.device)
            for rw, cw, rht in cases:
                amax = nvfp4_amax_tiles(x, t, rht)
                what = f"nvfp4 words {cfg.label()} {shape} rht={rht} sr={sr} dirs={rw, cw}"
                w = nvfp4_quantize_tiles(x, t, amax, seed, rw, cw, False, rht, sr, 1, config=cfg, words=True)
                ti = nvfp4_quantize_tiles(x, t, amax, seed, rw, cw, False, rht, sr, 1, words=False)
                for name, a, b in zip(("row", "row scales", "col", "col scales", "row gs", "col gs"), w, ti):
                    a, b = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
                    if name == "row" and rw:  # an inf's code (its scaled value NaN): the sign may differ
                        a, b = a & _row_sign_mask(x), b & _row_sign_mask(x)
                    if name == "col" and cw:  # so in an inf's columnwise block (every value inf or NaN)
                        a, b = a & _col_sign_mask(x), b & _col_sign_mask(x)
                    assert torch.equal(a, b), f"{what}: {name} differ"


def _row_sign_mask(x):
    """Per rowwise NVFP4 data byte of ``x``: ``0xFF`` less the sign bit of each non-finite
    element's code (the words kernel takes a code's sign from the input's bits, the tile
    kernel from the scaled value, a NaN there; ``nvfp4.words``' note "signs")."""
    bad = (~torch.isfinite(x)).to(torch.uint8)
    return (0xFF ^ ((bad[:, 0::2] << 3) | (bad[:, 1::2] << 7))).reshape(-1)

def _col_sign_mask(x):
    """Per columnwise NVFP4 data byte (``[K, M/2]``): ``0xFF`` less the two sign bits in each
    16×1 block holding a non-finite element (the words kernel's RHT takes a code's sign from
    the transformed value, the tile kernel from the scaled one, NaN there: ``kernels.
    _rht_words``)."""
    m, k = x.shape
    bad = (~torch.isfinite(x)).reshape(m // 16, 16, k).any(dim=1).t()  # [K, M/16]
    return (0xFF ^ (bad.to(torch.uint8) * 0x88)).repeat_interleave(8, dim=1).reshape(-1)


def test_nvfp4_words_lane_quads_only_where_a_row_block_is_one_quad():
    """The lane-quad row scales (``nvfp4.words``' note) assume each set's words ``[BM/16, 64]``
    two per thread, row ``i`` on warp ``i``: ``BK = 128`` and ``BM = 16·num_warps`` (the
    default among them); other configs keep the per-lane scales."""
    pytest.importorskip("triton")
    from hybrid_dist.kernels.nvfp4.words import words_lane_quads

    assert words_lane_quads(NVFP4_WORDS_DEFAULT) and words_lane_quads(NVFP4_WORDS_RHT_DEFAULT)
    assert words_lane_quads(NVFP4_WORDS_BOTH)
    quads = {c.label() for c in NVFP4_SWEEP if words_lane_quads(c)}
    assert quads == {"128x128/w8", "64x128/w4", "64x128/w4/r128", "64x128/w4/r80", "64x128/w4/r96"}, quads
    assert not words_lane_quads(TileConfig(bm=64, bk=256, num_warps=8))
    assert not words_lane_quads(TileConfig(bm=32, bk=128, num_warps=1))


def _check_nvfp4_rht_words_vs_tile():
    """The words kernel's RHT (signs in the unpacking, unscaled butterflies, block amax from
    the last stage's pairs, signs from the transformed bits: ``kernels.nvfp4._rht_words``) is
    bitwise the tile kernel's ``T x`` on random bf16 with tiny values (products and sums
    below ``2**-126``) and zeros (interpreter: IEEE fp32 without flushing; bf16 subnormal
    inputs are left out: the interpreter's bf16 → fp32 cast flushes them, the GPU's does not),
    two tile configs, row+col and columnwise only, whole and partial tiles; with stochastic
    rounding of one direction too (the tile kernel's Philox stream)."""
    from hybrid_dist.formats.numerics import hadamard16
    from hybrid_dist.kernels.nvfp4.configs import NVFP4_SWEEP, nvfp4_words_default

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(128, 256, generator=gen) * torch.exp2(torch.randint(-20, 20, (128, 1), generator=gen).float())
    x[:16, :8] *= 2.0**-120  # tiny normal bf16: the tile kernel's products x/4 and sums are subnormal
    x[16:32, 8:16] = 2.0**-126 * torch.randint(-3, 4, (16, 8), generator=gen) * (1 + torch.rand(16, 8, generator=gen))
    x[40, :4], x[50, 100] = -0.0, -0.0
    x = x.bfloat16()
    t = hadamard16(7)[0].contiguous()
    seed = torch.zeros(1, dtype=torch.int64)
    for xs in (x, x[:96, :160].contiguous()):  # whole tiles (the words kernel's EVEN) and partial ones
        _rht_words_vs_tile(xs, t, seed, (NVFP4_SWEEP[0], nvfp4_words_default(True, True)))
    # stochastic rounding (the tile kernel's Philox stream), ordinary values; also rowwise only
    xn = (torch.randn(128, 256, generator=gen) * 3).bfloat16()
    sr_seed = torch.tensor([(5 << 32) + 77])
    for xs in (xn, xn[:96, :160].contiguous()):
        _rht_words_vs_tile(xs, t, sr_seed, (NVFP4_SWEEP[0], nvfp4_words_default(True, True, True)), sr=True)

def _rht_words_vs_tile(x, t, seed, configs, sr=False):
    from hybrid_dist.kernels.nvfp4.quantize import nvfp4_amax_tiles, nvfp4_quantize_tiles

    amax = nvfp4_amax_tiles(x, t, True, out=torch.zeros(2))
    cases = (((False, True, True), (True, False, False), (True, False, True)) if sr
             else ((True, True, True), (False, True, True)))
    for cfg in configs:
        for rw, cw, rht in cases:
            w = nvfp4_quantize_tiles(x, t, amax, seed, rw, cw, False, rht, sr, 1, config=cfg, words=True)
            ti = nvfp4_quantize_tiles(x, t, amax, seed, rw, cw, False, rht, sr, 1, words=False)
            for name, a, b in zip(("row", "row scales", "col", "col scales", "row gs", "col gs"), w, ti):
                bits_equal(a, b, f"nvfp4 words vs tile {tuple(x.shape)} {cfg.label()} rht={rht} sr={sr} "
                                  f"dirs={rw, cw} {name}")
            if sr and rw:  # the noise is drawn: rounding to nearest gives other codes
                rne = nvfp4_quantize_tiles(x, t, amax, seed, rw, cw, False, rht, False, 1, config=cfg, words=True)
                assert not torch.equal(w[0], rne[0]), f"nvfp4 words sr {cfg.label()}: rowwise codes are RNE's"


CHECKS = ('nvfp4_rht_words_vs_tile',)


@slow  # minutes of interpreted kernels on two cores: the slow tier
@pytest.mark.parametrize("check", CHECKS)
def test_nvfp4_words_under_triton_interpreter(check):
    run_check_under_triton_interpreter("tests.kernels.nvfp4.test_words", check)
