"""Tile configs of the fused quantize kernels and the NVFP4 words-kernel dispatch (host side)."""

import pytest
import torch

from hybrid_dist.kernels.quant_tiles import (NVFP4_SWEEP, NVFP4_WORDS_BOTH, NVFP4_WORDS_DEFAULT,
                                             NVFP4_WORDS_RHT_DEFAULT, TileConfig, nvfp4_words_default)


def test_register_cap_is_a_gpu_launch_option_and_part_of_the_label():
    cfg = TileConfig(bm=64, bk=128, num_warps=4, maxnreg=128)
    assert cfg.label() == "64x128/w4/r128"
    assert cfg.launch_options(torch.device("cuda")) == {"num_warps": 4, "maxnreg": 128}
    assert cfg.launch_options(torch.device("cpu")) == {"num_warps": 4}  # the interpreter has no register cap
    assert TileConfig(bm=64, bk=128, num_warps=4).launch_options(torch.device("cuda")) == {"num_warps": 4}
    assert NVFP4_WORDS_DEFAULT in NVFP4_SWEEP and NVFP4_WORDS_RHT_DEFAULT in NVFP4_SWEEP  # tested on the GPU
    assert NVFP4_WORDS_BOTH in NVFP4_SWEEP


def test_nvfp4_words_default_caps_both_directions_at_96_registers():
    """Row+col (with or without RHT) at 96 registers; one direction uncapped, or 80 with RHT
    (a cap also raises a one-direction kernel's registers: ``quant_tiles``' comment)."""
    assert nvfp4_words_default(False, both=True) == nvfp4_words_default(True, both=True) == NVFP4_WORDS_BOTH
    assert NVFP4_WORDS_BOTH.maxnreg == 96
    assert nvfp4_words_default(False) == NVFP4_WORDS_DEFAULT and NVFP4_WORDS_DEFAULT.maxnreg is None
    assert nvfp4_words_default(True) == NVFP4_WORDS_RHT_DEFAULT and NVFP4_WORDS_RHT_DEFAULT.maxnreg == 80


@pytest.mark.parametrize("bad", [dict(bm=48, bk=128, num_warps=4), dict(bm=64, bk=16, num_warps=4)])
def test_tile_config_rejects_bad_shapes(bad):
    with pytest.raises(ValueError):
        TileConfig(**bad)


def test_words_kernel_takes_only_word_aligned_bf16():
    from hybrid_dist.kernels.quant_tiles import bf16_words

    x = torch.zeros(32, 64, dtype=torch.bfloat16)
    assert bf16_words(x)
    assert not bf16_words(x.float())
    assert not bf16_words(x[:, 1:33])  # odd start: not 4-byte aligned
    assert not bf16_words(torch.zeros(32, 66, dtype=torch.bfloat16)[:, :64].t().contiguous().t())  # column-major
    assert not bf16_words(torch.zeros(32, 65, dtype=torch.bfloat16)[:, :64])  # odd row stride
    assert bf16_words(torch.zeros(32, 66, dtype=torch.bfloat16)[:, :64])


@pytest.mark.parametrize("case", ["fp32", "M % 32", "odd start", "rowwise only"])
def test_mxfp8_words_kernel_refuses_what_it_cannot_read(case):
    """``words=True`` on an input the MXFP8 words kernel cannot take raises before any launch."""
    pytest.importorskip("triton")  # the kernel modules import Triton (absent on CPU-only installs)
    from hybrid_dist.kernels.mxfp8 import mxfp8_quantize_tiles

    x = torch.zeros(64, 64, dtype=torch.bfloat16)
    xi, rw, cw = {"fp32": (x.float(), True, True), "M % 32": (x[:40], True, True),
                  "odd start": (x[:, 1:33], False, True), "rowwise only": (x, True, False)}[case]
    with pytest.raises(ValueError, match="words kernel"):
        mxfp8_quantize_tiles(xi, torch.float8_e4m3fn, rw, cw, words=True)


def test_nvfp4_stochastic_rounding_refuses_wrapping_counters():
    """NVFP4 SR draws from 2·⌈M/16⌉·K uint32 Philox counters: a tensor that would wrap them (and
    repeat random bits) is refused before any launch."""
    pytest.importorskip("triton")
    from hybrid_dist.kernels.nvfp4 import nvfp4_quantize_tiles

    big = torch.zeros(1, dtype=torch.bfloat16).expand(2**20, 2**15 + 16)  # 2·2**16·(2**15 + 16) > 2**32
    t, amax, seed = torch.zeros(16), torch.ones(2), torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="Philox counters"):
        nvfp4_quantize_tiles(big, t, amax, seed, True, True, False, True, True, 1)
    with pytest.raises(ValueError, match="Philox counters"):  # rowwise only: the same counter space
        nvfp4_quantize_tiles(big, t, amax, seed, True, False, False, False, True, 1)


def test_nvfp4_words_lane_quads_only_where_a_row_block_is_one_quad():
    """The lane-quad row scales (``nvfp4_words``' note) assume each set's words ``[BM/16, 64]``
    two per thread, row ``i`` on warp ``i``: ``BK = 128`` and ``BM = 16·num_warps`` (the
    default among them); other configs keep the per-lane scales."""
    pytest.importorskip("triton")
    from hybrid_dist.kernels.nvfp4_words import words_lane_quads

    assert words_lane_quads(NVFP4_WORDS_DEFAULT) and words_lane_quads(NVFP4_WORDS_RHT_DEFAULT)
    assert words_lane_quads(NVFP4_WORDS_BOTH)
    quads = {c.label() for c in NVFP4_SWEEP if words_lane_quads(c)}
    assert quads == {"128x128/w8", "64x128/w4", "64x128/w4/r128", "64x128/w4/r80", "64x128/w4/r96"}, quads
    assert not words_lane_quads(TileConfig(bm=64, bk=256, num_warps=8))
    assert not words_lane_quads(TileConfig(bm=32, bk=128, num_warps=1))
