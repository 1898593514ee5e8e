"""Tile configs of the MXFP8 quantize kernels (``kernels.tile_config.TileConfig``): the
default of each kernel and the configs ``benchmarks/quantize.py --sweep`` times.

Each default is the fastest config of its kernel on an H100 at 16384x8192 bf16, timed side
by side; every config gives bitwise the same output (tested on the GPU and under the
interpreter). The fused passes are issue- or latency-bound, so the choice trades registers
per thread (spills) against warps per SM (latency hiding).
"""

from __future__ import annotations

from hybrid_dist.kernels.tile_config import TileConfig

# The 32-row-set kernel (``mxfp8.quantize``): one columnwise block per program (BM = 32), 2 warps.
MXFP8_DEFAULT = TileConfig(bm=32, bk=256, num_warps=2)
# The words kernel (``mxfp8.words``): 8 row sets of [BM/8, 32 words], one warp per 32-row
# block (4 threads along M, 8 along K, 4 words each); capped at 96 registers (at 80 it spills).
MXFP8_WORDS_DEFAULT = TileConfig(bm=128, bk=64, num_warps=4, maxnreg=96)

MXFP8_WORDS_SWEEP = (
    MXFP8_WORDS_DEFAULT,
    TileConfig(bm=128, bk=64, num_warps=4),
    TileConfig(bm=128, bk=64, num_warps=4, maxnreg=80),
    TileConfig(bm=64, bk=64, num_warps=2, maxnreg=96),
    TileConfig(bm=32, bk=64, num_warps=1, maxnreg=96),
    TileConfig(bm=32, bk=64, num_warps=1),
    TileConfig(bm=256, bk=64, num_warps=8, maxnreg=96),
)
MXFP8_SWEEP = (  # the 32-row-set kernel
    MXFP8_DEFAULT,
    TileConfig(bm=32, bk=128, num_warps=1),
    TileConfig(bm=32, bk=512, num_warps=4),
    TileConfig(bm=32, bk=256, num_warps=4),
    TileConfig(bm=32, bk=128, num_warps=2),
)

__all__ = ["MXFP8_DEFAULT", "MXFP8_SWEEP", "MXFP8_WORDS_DEFAULT", "MXFP8_WORDS_SWEEP"]
