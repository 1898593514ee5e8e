"""GEMMs: TFLOP/s per operand-format pair at 8192³ against bf16 cuBLAS in the same run
(``hybrid_dist.gemm.gemm_nt`` on pre-quantized operands, including any dequantize).
Prints one table. Run: ``python benchmarks/gemm.py``.
"""

from __future__ import annotations

import torch

import hybrid_dist as hd
from benchmarks._bench import bench_ms, print_table
from hybrid_dist.gemm import GemmConfig, gemm_nt

S = 8192
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
Q = {
    "fp8 e4m3": hd.Float8Quantizer(dtype=E4M3),
    "fp8 e5m2": hd.Float8Quantizer(dtype=E5M2),
    "fp8 1x128": hd.Float8BlockQuantizer(block="1x128"),
    "fp8 128x128": hd.Float8BlockQuantizer(block="128x128"),
    "mxfp8": hd.MXFP8Quantizer(),
    "nvfp4": hd.NVFP4Quantizer(),
    "nvfp4 2d": hd.NVFP4Quantizer(block_2d=True),
    "bf16": hd.IdentityQuantizer(),
}
PAIRS = [  # (A, B, fast_accum)
    ("fp8 e4m3", "fp8 e4m3", True), ("fp8 e4m3", "fp8 e4m3", False), ("fp8 e5m2", "fp8 e4m3", False),
    ("fp8 1x128", "fp8 128x128", False), ("fp8 1x128", "fp8 1x128", False),
    ("mxfp8", "mxfp8", False), ("nvfp4", "nvfp4 2d", False), ("nvfp4", "nvfp4", False),
    ("mxfp8", "nvfp4", False), ("nvfp4", "mxfp8", False), ("fp8 e5m2", "mxfp8", False),
    ("bf16", "mxfp8", False), ("bf16", "bf16", False),
]


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    a_hp = torch.randn(S, S, device="cuda", generator=g).bfloat16()
    b_hp = torch.randn(S, S, device="cuda", generator=g).bfloat16()
    flop = 2 * S**3
    bf16_ms = bench_ms(lambda: a_hp @ b_hp.t())
    rows = [["bf16 cuBLAS (a @ b.t())", "", bf16_ms, flop / bf16_ms / 1e9, 1.0]]
    for an, bn, fast in PAIRS:
        cfg = GemmConfig(use_fast_accum=fast)
        try:
            sa = Q[an].quantize_storages(a_hp, rowwise=True, columnwise=False)[0]
            sb = Q[bn].quantize_storages(b_hp, rowwise=True, columnwise=False)[0]
            ms = bench_ms(lambda: gemm_nt(sa, sb, out_dtype=torch.bfloat16, config=cfg))
        except Exception as e:  # keep the table: report the failure in its row
            rows.append([f"{an} x {bn}", f"failed: {type(e).__name__}: {e}"[:120], "", "", ""])
            continue
        rows.append([f"{an} x {bn}", "fast" if fast else "", ms, flop / ms / 1e9, bf16_ms / ms])
    again = bench_ms(lambda: a_hp @ b_hp.t())  # clocks drift under sustained load: bracket the run
    rows.append(["bf16 cuBLAS again (end of run)", "", again, flop / again / 1e9, bf16_ms / again])
    print_table(["A x B", "accum", "ms", "TFLOP/s", "x bf16"], rows,
                f"gemm_nt {S}^3, bf16 out, on {torch.cuda.get_device_name()}")


if __name__ == "__main__":
    main()
