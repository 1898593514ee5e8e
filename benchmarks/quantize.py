"""Quantize kernels: GB/s (bytes read + written) per format and direction set at
16384×8192 bf16, against a device copy measured in the same run. Prints one table.

Bytes counted: the input read once plus every output byte written (the fewest a fused
kernel must move); formats with a per-tensor current amax read the input a second time,
which is counted too (``reads`` column). Run: ``python benchmarks/quantize.py``.
"""

from __future__ import annotations

import torch

import hybrid_dist as hd
from benchmarks._bench import bench_ms, copy_gbps, print_table

M, K = 16384, 8192
E5M2 = torch.float8_e5m2

CASES = [  # (name, quantizer, rowwise, columnwise, input reads)
    ("fp8 current e4m3", hd.Float8Quantizer(), True, True, 2),
    ("fp8 current e5m2", hd.Float8Quantizer(dtype=E5M2), True, True, 2),
    ("fp8 current e4m3 row only", hd.Float8Quantizer(), True, False, 2),
    ("fp8 delayed e4m3", hd.Float8Quantizer(scaling="delayed"), True, True, 1),
    ("fp8 block 1x128", hd.Float8BlockQuantizer(block="1x128"), True, True, 1),
    ("fp8 block 128x128", hd.Float8BlockQuantizer(block="128x128"), True, True, 1),
    ("mxfp8", hd.MXFP8Quantizer(), True, True, 1),
    ("mxfp8 row only", hd.MXFP8Quantizer(), True, False, 1),
    ("nvfp4", hd.NVFP4Quantizer(), True, True, 2),
    ("nvfp4 2d (weights)", hd.NVFP4Quantizer(block_2d=True), True, True, 2),
    ("nvfp4 rht (col RHT)", hd.NVFP4Quantizer(rht=True), True, True, 2),
    ("nvfp4 rht+sr (grads)", hd.NVFP4Quantizer(rht=True, stochastic_rounding=True), True, True, 2),
]


def main() -> None:
    x = torch.randn(M, K, device="cuda").bfloat16()
    copy = copy_gbps(M * K)
    rows = [["device copy", "", 1, copy, 1.0]]
    for name, q, rw, cw, reads in CASES:
        state = q.make_state()
        if state is not None and hasattr(state, "to"):
            state.to("cuda")
        try:
            row, col = q.quantize_storages(x, rowwise=rw, columnwise=cw, state=state)
            out_bytes = sum(s.nbytes() for s in (row, col) if s is not None)
            ms = bench_ms(lambda: q.quantize_storages(x, rowwise=rw, columnwise=cw, state=state))
        except Exception as e:  # keep the table: report the failure in its row
            rows.append([name, f"failed: {type(e).__name__}: {e}"[:120], "", "", ""])
            continue
        gbps = (reads * x.numel() * 2 + out_bytes) / ms / 1e6
        dirs = "+".join(d for d, w in (("row", rw), ("col", cw)) if w)
        rows.append([name, dirs, reads, gbps, gbps / copy])
    dev = torch.cuda.get_device_name()
    print_table(["format", "directions", "input reads", "GB/s", "x copy"], rows,
                f"quantize {M}x{K} bf16 on {dev}")


if __name__ == "__main__":
    main()
