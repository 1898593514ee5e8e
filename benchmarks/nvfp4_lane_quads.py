"""NVFP4 1D words kernel (``kernels/nvfp4/words.py``) with and without the lane-quad row scales,
uncapped and capped at 128 and 96 registers (the row+col default), side by side in one run:
fused pass alone (amax given), 16384×8192 bf16, row+col; every variant's outputs compared
bitwise with the no-quad kernel's.
Prints one table. Run: ``python -m benchmarks.nvfp4_lane_quads`` (one GPU, < 1 min)."""

from __future__ import annotations

import torch

from benchmarks._bench import bench_ms, bytes_equal, print_table
from hybrid_dist.kernels._jit_common import cdiv
from hybrid_dist.kernels.nvfp4.quantize import _nvfp4_shapes, _rht_row, nvfp4_amax_tiles
from hybrid_dist.kernels.nvfp4.words import nvfp4_words_kernel
from hybrid_dist.kernels.tile_config import TileConfig

M, K = 16384, 8192


def _launcher(x, t, amax, cfg: TileConfig, quad: bool):
    xw = x.view(torch.int32)
    outs = [torch.empty(s, dtype=d, device=x.device) for s, d in _nvfp4_shapes(M, K, True, True, 1)]
    gs = [torch.empty((), dtype=torch.float32, device=x.device) for _ in range(2)]
    seed = torch.zeros(1, dtype=torch.int64, device=x.device)  # unread without SR
    grid = (cdiv(M, cfg.bm), cdiv(K, cfg.bk))

    def run():
        nvfp4_words_kernel[grid](xw, t, amax, seed, outs[0], outs[1], outs[2].view(torch.int64), outs[3], *gs, M,
                                 K, xw.stride(0), ROW=True, COL=True, RHT=False, SR=False, BM=cfg.bm, BK=cfg.bk,
                                 QUAD=quad,
                                 EVEN=M % cfg.bm == 0 and K % cfg.bk == 0,
                                 **cfg.launch_options(x.device))
        return outs
    return run


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(M, K, device="cuda").bfloat16()
    t = _rht_row(0, x.device)  # read by the kernel only with RHT
    amax = nvfp4_amax_tiles(x, t, False)
    base = [o.clone() for o in _launcher(x, t, amax, TileConfig(bm=64, bk=128, num_warps=4), False)()]
    rows = []
    for rep in range(2):
        for cap in (128, 96, None):
            cfg = TileConfig(bm=64, bk=128, num_warps=4, maxnreg=cap)
            for quad in (False, True):
                run = _launcher(x, t, amax, cfg, quad)
                same = bytes_equal(run(), base)
                rows.append([rep, cfg.label(), quad, bench_ms(run, rep_ms=150), same])
    print_table(["repetition", "tile", "lane quads", "ms", "bitwise = no quads"], rows,
                f"nvfp4_words fused pass {M}x{K} bf16 row+col on {torch.cuda.get_device_name()}")


if __name__ == "__main__":
    main()
