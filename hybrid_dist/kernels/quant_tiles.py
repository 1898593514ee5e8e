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


# Defaults: the fastest config of each kernel on an H100 (16384x8192 bf16, timed side by side,
# outputs bitwise equal across configs). The fused passes are issue- or latency-bound, so the
# choice trades registers per thread (spills) against warps per SM (latency hiding).
# MXFP8, 32-row-set kernel: one columnwise block per program (BM = 32), 2 warps.
MXFP8_DEFAULT = TileConfig(bm=32, bk=256, num_warps=2)
# MXFP8 words kernel: 8 row sets of [BM/8, 32 words], one warp per 32-row block (4 threads
# along M, 8 along K, 4 words each); capped at 96 registers (at 80 it spills).
MXFP8_WORDS_DEFAULT = TileConfig(bm=128, bk=64, num_warps=4, maxnreg=96)
# NVFP4 tile kernel: 1x16 blocks at 128x128 with 8 warps, 16x16 blocks at 64x128 with 4 warps;
# uncapped (register caps made the stochastic-rounding kernel slower).
NVFP4_DEFAULT = TileConfig(bm=128, bk=128, num_warps=8)  # 1x16 blocks (with or without RHT / SR)
NVFP4_2D_DEFAULT = TileConfig(bm=64, bk=128, num_warps=4)  # 16x16 blocks (weights)
# NVFP4 words kernel, one direction without RHT or SR: uncapped (a cap was slower).
NVFP4_WORDS_DEFAULT = TileConfig(bm=64, bk=128, num_warps=4)
# One direction with RHT (the columnwise wgrad operand): capped at 80 registers, which fits 24
# warps per SM instead of 16 without a spill.
NVFP4_WORDS_RHT_DEFAULT = TileConfig(bm=64, bk=128, num_warps=4, maxnreg=80)
# Both directions (with or without RHT), and SR of one direction: capped at 96, where neither
# spills (RHT + SR columnwise spills at 80). A cap also raises a one-direction kernel's
# registers to it, so one direction without SR keeps the configs above.
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
    TileConfig(bm=64, bk=128, num_warps=4, maxnreg=128),  # the words kernel capped at 128
    NVFP4_WORDS_RHT_DEFAULT,
    NVFP4_WORDS_BOTH,
)

__all__ = ["MXFP8_DEFAULT", "MXFP8_SWEEP", "MXFP8_WORDS_DEFAULT", "MXFP8_WORDS_SWEEP", "NVFP4_2D_DEFAULT",
           "NVFP4_DEFAULT", "NVFP4_SWEEP", "NVFP4_WORDS_BOTH", "NVFP4_WORDS_DEFAULT", "NVFP4_WORDS_RHT_DEFAULT",
           "TileConfig", "bf16_words", "nvfp4_default", "nvfp4_words_default"]
