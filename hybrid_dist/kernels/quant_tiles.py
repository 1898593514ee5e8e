"""Tile configurations of the fused MXFP8 / NVFP4 quantize kernels.

A config is a plain frozen dataclass passed to the launch functions (no autotuning: the
choice is explicit, deterministic and the same under ``torch.compile``).
``benchmarks/quantize.py --sweep`` times every config of :data:`MXFP8_WORDS_SWEEP`,
:data:`MXFP8_SWEEP` and :data:`NVFP4_SWEEP` so the default can be picked on the target GPU.

Tile shapes: a program owns ``x[BM, BK]`` and reads it as ``G`` interleaved row sets
(``G = 32`` for the MXFP8 row-set kernel, 8 for ``mxfp8_words``, 16 for NVFP4), each
``[BM/G, BK]``: set ``j`` holds rows ``m ≡ j (mod G)`` (``mxfp8_words``: see its note);
the MXFP8 row-set tiles are one columnwise block (``BM = 32``). ``BM/G * BK`` should be at
least ``4 * 32 * num_warps`` so no thread holds a replicated element; ``8 * 32 * num_warps``
gives 16-byte loads.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True, kw_only=True)
class TileConfig:
    """``bm`` rows (M) × ``bk`` columns (K) per program, ``num_warps`` per program;
    ``maxnreg``: a register cap per thread (None: the compiler's choice)."""

    bm: int
    bk: int
    num_warps: int
    maxnreg: int | None = None

    def __post_init__(self):
        for name in ("bm", "bk", "num_warps"):
            v = getattr(self, name)
            if v <= 0 or v & (v - 1):
                raise ValueError(f"TileConfig.{name} must be a positive power of two, got {v}")
        if self.bm < 32 or self.bk < 32:
            raise ValueError(f"TileConfig needs bm >= 32 and bk >= 32 (one MXFP8 block), got {self}")

    def label(self) -> str:
        cap = "" if self.maxnreg is None else f"/r{self.maxnreg}"
        return f"{self.bm}x{self.bk}/w{self.num_warps}{cap}"

    def launch_options(self, device) -> dict:
        """Triton launch keywords: ``num_warps``, and ``maxnreg`` on a GPU (the interpreter has none)."""
        opts = {"num_warps": self.num_warps}
        if self.maxnreg is not None and device.type == "cuda":
            opts["maxnreg"] = self.maxnreg
        return opts


def bf16_words(x: torch.Tensor) -> bool:
    """``x`` bf16 with unit column stride, even K, even row stride and a 4-byte aligned start:
    readable as int32 words ``[M, K/2]`` (the ``*_words`` kernels)."""
    return (x.dtype == torch.bfloat16 and x.stride(-1) == 1 and x.shape[-1] % 2 == 0
            and (x.shape[0] <= 1 or x.stride(0) % 2 == 0) and x.data_ptr() % 4 == 0)


# Defaults from the SASS each config compiles to (sm_90, Triton 3.9, no GPU run yet):
# thread-instructions per element of the row+col pass, registers/thread. The kernels are
# issue-bound, not bandwidth-bound, when this count is high (the v1 kernels: MXFP8 49-100,
# NVFP4 1D 117-165, RHT 116-128, 2D 47-64 at their autotuned configs). BM=32 tiles with 8
# elements per thread keep each column block's rows inside one thread.
#   MXFP8 row+col (32 row sets, ninth session, sm_90 SASS): 32x256/w2 15.2 (167 regs), 32x256/w4 23.8 (126)
#   NVFP4 1D      : 32x256/w2 47.4 (174 regs), 32x128/w1 47.1, 64x128/w4 59.9
#   NVFP4 RHT     : 32x256/w2 52.1, 64x128/w4 64.6;  2D: 32x256/w2 22.2 (255 regs), 64x256/w4 22.6
#   NVFP4 RHT+SR  : 32x256/w2 111.9 (Philox), 64x128/w4 125.6
#   (NVFP4, twelfth session, cheaper block scales and sign: 1D 128x128/w8 49.6 (114 regs),
#   64x256/w4 43.1 (168); RHT 128x128/w8 55.5 (107); RHT+SR 128x128/w8 115.1 (126))
# MXFP8 default: the fastest of the sweep on an H100 (ninth session, 16384x8192 bf16, row+col,
# x copy over two runs): 32x256/w2 0.739 / 0.742, 32x512/w4 0.737 / 0.738, 32x256/w4 0.734 /
# 0.735, 32x128/w1 0.732 / 0.731, 32x128/w2 0.719 / 0.717 (mxfp8_v1: 0.708 / 0.708).
MXFP8_DEFAULT = TileConfig(bm=32, bk=256, num_warps=2)
# MXFP8 with columnwise from word-readable bf16 (``mxfp8_words``): 8 row sets of [BM/8, 32 words],
# one warp per 32-row block (4 threads along M, 8 along K, 4 words each). Fourteenth session, one
# H100 run, 16384x8192 row+col, kernel + scale unstaging, x copy: 128x64/w4/r96 0.888 (116 registers
# uncapped), 128x64/w4 0.886, 32x64/w1 0.876, 64x64/w2/r96 0.877, 32x64/w1/r96 0.867,
# 256x64/w8/r96 0.856, 128x64/w4/r80 0.749 (spills); the row-set kernel 0.742 in the same run.
MXFP8_WORDS_DEFAULT = TileConfig(bm=128, bk=64, num_warps=4, maxnreg=96)
# NVFP4 defaults per block shape: the fastest fused pass of a one-run H100 sweep (twelfth
# session, 16384x8192 bf16, x copy): 1x16 blocks 128x128/w8 (1D 0.485, RHT 0.439, RHT+SR 0.222;
# 64x128/w4 0.447 / 0.395 / 0.193, 64x256/w8 0.478 / 0.434 / 0.219, 8 elements per thread
# (64x256/w4, 168 registers) 0.421 / 0.396); 16x16 blocks 64x128/w4 (0.852; 128x128/w8 0.595).
# The 8-bit SR kernel (fifteenth session, one H100 run, fused pass ms, SR / RHT+SR): 128x128/w8
# 0.3035 / 0.3379, 128x128/w8/r128 0.3068 / 0.3416, 64x256/w8 0.3862 / 0.3445.
NVFP4_DEFAULT = TileConfig(bm=128, bk=128, num_warps=8)  # 1x16 blocks (with or without RHT / SR)
NVFP4_2D_DEFAULT = TileConfig(bm=64, bk=128, num_warps=4)  # 16x16 blocks (weights)
# 1x16 blocks without RHT or SR from bf16 (``nvfp4_words``): thirteenth session, one H100 run,
# fused pass 16384x8192: 64x128/w4 capped at 128 registers 0.2535 ms (16 warps per SM), uncapped
# (137 registers) 0.2838, 128x128/w8 0.2644, 64x256/w4/r168 0.3550, 32x128/w2 0.3018. Sixteenth
# session, with the lane-quad row scales (``nvfp4_words``' note; fewer registers): one H100 run, two
# repetitions, row+col 64x128/w4 uncapped 0.2091 / 0.2099 ms, capped 0.2133 / 0.2134 (the capped
# kernel without quads 0.2239 / 0.2244); rowwise only (no quads) uncapped 0.1356, capped 0.1539;
# columnwise only 0.1292 / 0.1296. So the cap is gone.
NVFP4_WORDS_DEFAULT = TileConfig(bm=64, bk=128, num_warps=4)
# With RHT (its columnwise direction transformed in registers) the words kernel takes 128
# registers uncapped (16 warps per SM); capped at 80 it takes no spill and 24 warps fit.
# Nineteenth session, one H100 run, fused pass 16384x8192 row+col, two repetitions: uncapped
# 0.2499 / 0.2487 ms, /r88 0.2399 / 0.2379, /r80 0.2373 / 0.2372, /r72 0.2537 / 0.2539 (outputs
# bitwise equal); without RHT every cap was slower (uncapped, 96 registers: 0.2130 / 0.2124;
# /r88 0.2426, /r80 0.2493, /r72 0.2304). Another run, RHT columnwise only: uncapped 0.1508,
# /r96 0.1433, /r88 0.1432, /r80 0.1410 (medians of three). The SR tile kernel ran slower
# capped (``benchmarks/README.md``).
NVFP4_WORDS_RHT_DEFAULT = TileConfig(bm=64, bk=128, num_warps=4, maxnreg=80)
# Both directions, with or without RHT, since the twenty-second session's sign handling
# (``nvfp4_words``' note "signs"; 114 / 127 registers uncapped, neither spills at 96): one H100
# call, fused pass 16384x8192 row+col, medians of 5 and 3 interleaved rounds, against the
# kernel before it (1D uncapped, RHT /r80): 1D uncapped 0.2120 / 0.2132 ms, /r96 0.2070 / 0.2020,
# /r104 0.2132, /r128 0.2091 (before: 0.2123 / 0.2091); RHT /r80 0.2448 / 0.2483 (56 bytes
# spilled), /r88 0.2355, /r96 0.2348 / 0.2373, uncapped 0.2388 (before: 0.2385 / 0.2384). A
# cap also raises a one-direction kernel's registers to it (columnwise 1D: 56 -> 96), so one
# direction keeps the configs above. With the row scales stored in place (``nvfp4_words``' note
# "row scales in place"; 108 / 106 registers uncapped), one call, 5 rounds: 1D /r96 0.1921 ms,
# /r88 0.1950, uncapped 0.1973; RHT /r96 0.2256, /r104 0.2324, uncapped 0.2356.
NVFP4_WORDS_BOTH = TileConfig(bm=64, bk=128, num_warps=4, maxnreg=96)


def nvfp4_words_default(rht: bool, both: bool = False, sr: bool = False) -> TileConfig:
    """The ``nvfp4_words`` tile config, with or without the columnwise RHT, for both
    directions or one, with or without stochastic rounding (one direction; RHT + SR
    columnwise spills at 80 registers: 72 bytes of stack, none at 96; sm_90, offline)."""
    if both or sr:
        return NVFP4_WORDS_BOTH
    return NVFP4_WORDS_RHT_DEFAULT if rht else NVFP4_WORDS_DEFAULT


def nvfp4_default(block_rows: int) -> TileConfig:
    """The NVFP4 tile config for ``block_rows`` (1: 1x16 blocks, 16: 16x16 blocks)."""
    return NVFP4_2D_DEFAULT if block_rows == 16 else NVFP4_DEFAULT


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
    TileConfig(bm=64, bk=128, num_warps=4, maxnreg=128),  # the words default before the lane quads
    NVFP4_WORDS_RHT_DEFAULT,
    NVFP4_WORDS_BOTH,
)

__all__ = ["MXFP8_DEFAULT", "MXFP8_SWEEP", "MXFP8_WORDS_DEFAULT", "MXFP8_WORDS_SWEEP", "NVFP4_2D_DEFAULT",
           "NVFP4_DEFAULT", "NVFP4_SWEEP", "NVFP4_WORDS_BOTH", "NVFP4_WORDS_DEFAULT", "NVFP4_WORDS_RHT_DEFAULT",
           "TileConfig", "bf16_words", "nvfp4_default", "nvfp4_words_default"]
