"""``kernels.tile_config``: the tile config of the fused quantize kernels and the words kernels' input test.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_dist.kernels.nvfp4.configs import (NVFP4_SWEEP, NVFP4_WORDS_BOTH, NVFP4_WORDS_DEFAULT,
                                              NVFP4_WORDS_RHT_DEFAULT)
from hybrid_dist.kernels.tile_config import TileConfig


def test_register_cap_is_a_gpu_launch_option_and_part_of_the_label():
    cfg = TileConfig(bm=64, bk=128, num_warps=4, maxnreg=128)
    assert cfg.label() == "64x128/w4/r128"
    assert cfg.launch_options(torch.device("cuda")) == {"num_warps": 4, "maxnreg": 128}
    assert cfg.launch_options(torch.device("cpu")) == {"num_warps": 4}  # the interpreter has no register cap
    assert TileConfig(bm=64, bk=128, num_warps=4).launch_options(torch.device("cuda")) == {"num_warps": 4}
    assert NVFP4_WORDS_DEFAULT in NVFP4_SWEEP and NVFP4_WORDS_RHT_DEFAULT in NVFP4_SWEEP  # tested on the GPU
    assert NVFP4_WORDS_BOTH in NVFP4_SWEEP


@pytest.mark.parametrize("bad", [dict(bm=48, bk=128, num_warps=4), dict(bm=64, bk=16, num_warps=4)])
def test_tile_config_rejects_bad_shapes(bad):
    with pytest.raises(ValueError):
        TileConfig(**bad)


def test_words_kernel_takes_only_word_aligned_bf16():
    from hybrid_dist.kernels.tile_config import bf16_words

    x = torch.zeros(32, 64, dtype=torch.bfloat16)
    assert bf16_words(x)
    assert not bf16_words(x.float())
    assert not bf16_words(x[:, 1:33])  # odd start: not 4-byte aligned
    assert not bf16_words(torch.zeros(32, 66, dtype=torch.bfloat16)[:, :64].t().contiguous().t())  # column-major
    assert not bf16_words(torch.zeros(32, 65, dtype=torch.bfloat16)[:, :64])  # odd row stride
    assert bf16_words(torch.zeros(32, 66, dtype=torch.bfloat16)[:, :64])
