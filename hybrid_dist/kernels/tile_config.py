"""The tile configuration of the fused MXFP8 / NVFP4 quantize kernels, and the input test
of the ``*_words`` kernels. The configs themselves: ``kernels.mxfp8.configs`` and
``kernels.nvfp4.configs``.

A config is a plain frozen dataclass passed to the launch functions (no autotuning: the
choice is explicit, deterministic and the same under ``torch.compile``).
``benchmarks/quantize.py --sweep`` times every config of each format's ``*_SWEEP`` so the
default can be picked on the target GPU.

Tile shapes: a program owns ``x[BM, BK]`` and reads it as ``G`` interleaved row sets
(``G = 32`` for the MXFP8 row-set kernel, 8 for ``mxfp8.words``, 16 for NVFP4), each
``[BM/G, BK]``: set ``j`` holds rows ``m ≡ j (mod G)`` (``mxfp8.words``: see its note);
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


__all__ = ["TileConfig", "bf16_words"]
