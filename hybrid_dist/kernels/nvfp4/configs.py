"""Tile configs of the NVFP4 quantize kernels (``kernels.tile_config.TileConfig``): the
default of each kernel and direction set, and the configs ``benchmarks/quantize.py --sweep``
times.

Each default is the fastest config of its kernel on an H100 at 16384x8192 bf16, timed side
by side; every config gives bitwise the same output (tested on the GPU and under the
interpreter). The fused passes are issue-bound, so the choice trades registers per thread
(spills) against warps per SM (latency hiding).
"""

from __future__ import annotations

from hybrid_dist.kernels.tile_config import TileConfig

# The tile kernel (``nvfp4.tiles``): 1x16 blocks at 128x128 with 8 warps, 16x16 blocks at
# 64x128 with 4 warps; uncapped (register caps made the stochastic-rounding kernel slower).
NVFP4_DEFAULT = TileConfig(bm=128, bk=128, num_warps=8)  # 1x16 blocks (with or without RHT / SR)
NVFP4_2D_DEFAULT = TileConfig(bm=64, bk=128, num_warps=4)  # 16x16 blocks (weights)
# The words kernel (``nvfp4.words``), one direction without RHT or SR: uncapped (a cap was slower).
NVFP4_WORDS_DEFAULT = TileConfig(bm=64, bk=128, num_warps=4)
# One direction with RHT (the columnwise wgrad operand): capped at 80 registers, which fits 24
# warps per SM instead of 16 without a spill.
NVFP4_WORDS_RHT_DEFAULT = TileConfig(bm=64, bk=128, num_warps=4, maxnreg=80)
# Both directions (with or without RHT), and SR of one direction: capped at 96, where neither
# spills (RHT + SR columnwise spills at 80). A cap also raises a one-direction kernel's
# registers to it, so one direction without SR keeps the configs above.
NVFP4_WORDS_BOTH = TileConfig(bm=64, bk=128, num_warps=4, maxnreg=96)


def nvfp4_words_default(rht: bool, both: bool = False, sr: bool = False) -> TileConfig:
    """The ``nvfp4.words`` tile config, with or without the columnwise RHT, for both
    directions or one, with or without stochastic rounding (one direction; RHT + SR
    columnwise spills at 80 registers: 72 bytes of stack, none at 96; sm_90, offline)."""
    if both or sr:
        return NVFP4_WORDS_BOTH
    return NVFP4_WORDS_RHT_DEFAULT if rht else NVFP4_WORDS_DEFAULT


def nvfp4_default(block_rows: int) -> TileConfig:
    """The NVFP4 tile config for ``block_rows`` (1: 1x16 blocks, 16: 16x16 blocks)."""
    return NVFP4_2D_DEFAULT if block_rows == 16 else NVFP4_DEFAULT


NVFP4_SWEEP = (
    NVFP4_DEFAULT,
    NVFP4_2D_DEFAULT,
    TileConfig(bm=64, bk=256, num_warps=8),
    TileConfig(bm=32, bk=256, num_warps=2),
    TileConfig(bm=32, bk=128, num_warps=1),
    TileConfig(bm=64, bk=128, num_warps=2),
    TileConfig(bm=64, bk=256, num_warps=4),
    TileConfig(bm=64, bk=64, num_warps=1),
    NVFP4_WORDS_DEFAULT,  # (= NVFP4_2D_DEFAULT; listed for the words kernel)
    TileConfig(bm=64, bk=128, num_warps=4, maxnreg=128),  # the words kernel capped at 128
    NVFP4_WORDS_RHT_DEFAULT,
    NVFP4_WORDS_BOTH,
)

__all__ = ["NVFP4_2D_DEFAULT", "NVFP4_DEFAULT", "NVFP4_SWEEP", "NVFP4_WORDS_BOTH", "NVFP4_WORDS_DEFAULT",
           "NVFP4_WORDS_RHT_DEFAULT", "nvfp4_default", "nvfp4_words_default"]
