"""``inspection.quant_stats`` of one operand direction: the fused CUDA kernel
(``kernels.stats``) against the torch ops it replaces, per format, on one tensor.

    python -m benchmarks.stats [--shape 8192 14336]

ms of ``quant_stats`` (both include the block-scale histogram and the RHT domain where the
format has one); the fused path's fields are checked against the torch path's first.
"""

from __future__ import annotations

import argparse
import math

import torch

from benchmarks._bench import bench_ms, print_table
from hybrid_dist.formats import Float8Quantizer, MXFP8Quantizer, NVFP4Quantizer
from hybrid_dist.inspection import stats

CASES = {"fp8_e4m3": Float8Quantizer(), "mxfp8": MXFP8Quantizer(), "nvfp4": NVFP4Quantizer(),
         "nvfp4_rht": NVFP4Quantizer(rht=True)}


def _torch_stats(x, st):
    fused = stats._fused_head
    stats._fused_head = lambda *a: None
    try:
        return stats.quant_stats(x, st)
    finally:
        stats._fused_head = fused


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs=2, default=(8192, 14336))
    args = p.parse_args()
    x = torch.randn(*args.shape, device="cuda", dtype=torch.bfloat16)
    rows = []
    for name, q in CASES.items():
        for direction in ("rowwise", "columnwise"):
            row, col = q.quantize_storages(x, rowwise=direction == "rowwise", columnwise=direction == "columnwise")
            st = row if row is not None else col
            ref, got = _torch_stats(x, st), stats.quant_stats(x, st)
            sig = stats.FIELDS.index("signal_norm")
            assert torch.equal(ref[[0, 3, 4, 5]], got[[0, 3, 4, 5]]), (name, direction)
            assert math.isclose(ref[sig], got[sig], rel_tol=1e-5), (name, direction)
            t_ms = bench_ms(lambda: _torch_stats(x, st))
            f_ms = bench_ms(lambda: stats.quant_stats(x, st))
            rows.append([name, direction, t_ms, f_ms, t_ms / f_ms])
    print_table(["format", "direction", "torch ms", "fused ms", "speedup"], rows,
                f"quant_stats of {tuple(args.shape)} bf16 on {torch.cuda.get_device_name()}")


if __name__ == "__main__":
    main()
