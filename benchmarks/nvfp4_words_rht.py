"""NVFP4 1×16 with a Hadamard-domain columnwise direction (RHT): the fused pass of the tile
kernel (``nvfp4.tiles``) against the words kernel (``nvfp4.words``), side by side in one run,
at 16384×8192 bf16, row+col (the ``nvfp4`` recipe's inputs) and columnwise only (the
``mxfp8_fwd_nvfp4_bwd`` recipe's). Every output is checked bitwise against the tile kernel's.
Then the stochastic-rounding tile kernel (without and with RHT) at register caps. Prints two
tables. Run: ``python -m benchmarks.nvfp4_words_rht``.
"""

from __future__ import annotations

import dataclasses

import torch

from benchmarks._bench import bench_ms, bytes_equal, print_table
from hybrid_dist.kernels.nvfp4.quantize import _rht_row, nvfp4_amax_tiles, nvfp4_quantize_tiles
from hybrid_dist.kernels.nvfp4.configs import NVFP4_DEFAULT, NVFP4_WORDS_BOTH, NVFP4_WORDS_RHT_DEFAULT
from hybrid_dist.kernels.tile_config import TileConfig

M, K = 16384, 8192
# the defaults first (row+col: 96 registers; one direction: 80), then the caps and tiles they
# were chosen among
WORDS_CONFIGS = (NVFP4_WORDS_BOTH, NVFP4_WORDS_RHT_DEFAULT, TileConfig(bm=64, bk=128, num_warps=4),
                 *(TileConfig(bm=64, bk=128, num_warps=4, maxnreg=r) for r in (128, 88, 72)),
                 TileConfig(bm=128, bk=128, num_warps=8), TileConfig(bm=32, bk=128, num_warps=2))
SR_CONFIGS = (NVFP4_DEFAULT, *(dataclasses.replace(NVFP4_DEFAULT, maxnreg=r) for r in (128, 96, 80)))


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(M, K, device="cuda").bfloat16()
    t = _rht_row(0, x.device)
    amax = nvfp4_amax_tiles(x, t, True)
    seed = torch.zeros(1, dtype=torch.int64, device=x.device)
    rows = []
    for rep in range(2):
        for rw in (True, False):
            def run(cfg, words, rw=rw):
                return nvfp4_quantize_tiles(x, t, amax, seed, rw, True, False, True, False, 1, config=cfg, words=words)

            base = [o.clone() for o in run(NVFP4_DEFAULT, False)]
            for cfg, words in [(NVFP4_DEFAULT, False)] + [(c, True) for c in WORDS_CONFIGS]:
                same = bytes_equal(run(cfg, words), base)
                rows.append([rep, "row+col" if rw else "col", "words" if words else "tiles", cfg.label(),
                             bench_ms(lambda cfg=cfg, words=words: run(cfg, words), rep_ms=150), same])
    print_table(["repetition", "directions", "kernel", "tile", "ms", "bitwise = tiles"], rows,
                f"nvfp4 RHT fused pass {M}x{K} bf16 on {torch.cuda.get_device_name()}")
    print_table(["repetition", "transform", "tile", "ms", "bitwise = default"], _sr_rows(x, t, amax, seed),
                f"nvfp4 stochastic-rounding tile kernel, row+col fused pass {M}x{K} bf16, at register caps")


def _sr_rows(x, t, amax, seed):
    """The SR tile kernel (gradients) at its default and the register caps that helped the RHT
    words kernel: none did here (the caps' rows are why ``NVFP4_DEFAULT`` stays uncapped)."""
    rows = []
    for rep in range(2):
        for rht in (False, True):
            def run(cfg, rht=rht):
                return nvfp4_quantize_tiles(x, t, amax, seed, True, True, False, rht, True, 1, config=cfg)

            base = [o.clone() for o in run(NVFP4_DEFAULT)]
            for cfg in SR_CONFIGS:
                rows.append([rep, "RHT" if rht else "none", cfg.label(), bench_ms(lambda cfg=cfg: run(cfg), rep_ms=150),
                             bytes_equal(run(cfg), base)])
    return rows


if __name__ == "__main__":
    main()
