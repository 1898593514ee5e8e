"""GEMMs: TFLOP/s per operand-format pair at 8192³ against bf16 cuBLAS in the same run
(``hybrid_dist.gemm.gemm_nt`` on pre-quantized operands, including any dequantize).
Prints one table. Run: ``python -m benchmarks.gemm``. Timing: ``--rounds`` interleaved
rounds (``_bench.interleaved_ms``); ``x bf16`` is the median of the per-round ratios to the
bf16 cuBLAS GEMM timed in the same round, with its [min, max].
"""

from __future__ import annotations

import argparse
import statistics

import torch

import hybrid_dist as hd
from benchmarks._bench import interleaved_ms, print_table
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


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3,
                   help="timing rounds; each round times bf16 cuBLAS and every pair once, in turn")
    return p.parse_args()


def _label(a: str, b: str, fast: bool) -> tuple[str, str]:
    return f"{a} x {b}", "fast" if fast else ""


def _pair_fns(a_hp, b_hp) -> tuple[dict, dict[tuple[str, str], str]]:
    """``({label: GEMM callable}, {label: failure})`` of every pair, on operands quantized once."""
    fns, failed = {}, {}
    for an, bn, fast in PAIRS:
        label, cfg = _label(an, bn, fast), GemmConfig(use_fast_accum=fast)
        try:
            sa = Q[an].quantize_storages(a_hp, rowwise=True, columnwise=False)[0]
            sb = Q[bn].quantize_storages(b_hp, rowwise=True, columnwise=False)[0]
            fns[label] = lambda sa=sa, sb=sb, cfg=cfg: gemm_nt(sa, sb, out_dtype=torch.bfloat16, config=cfg)
        except Exception as e:  # keep the table: report the failure in its row
            failed[label] = f"failed: {type(e).__name__}: {e}"[:120]
    return fns, failed


def main() -> None:
    args = _args()
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    g = torch.Generator(device="cuda").manual_seed(0)
    a_hp = torch.randn(S, S, device="cuda", generator=g).bfloat16()
    b_hp = torch.randn(S, S, device="cuda", generator=g).bfloat16()
    flop = 2 * S**3
    bf16 = ("bf16 cuBLAS (a @ b.t())", "")
    fns, failed = _pair_fns(a_hp, b_hp)
    ms, errors = interleaved_ms({bf16: lambda: a_hp @ b_hp.t(), **fns}, args.rounds)
    failed.update(errors)
    rows = []
    for label in [bf16, *[_label(a, b, fast) for a, b, fast in PAIRS]]:
        if label in failed:
            rows.append([*label, failed[label], "", "", ""])
            continue
        ratios = [b / u for b, u in zip(ms[bf16], ms[label])]
        med = statistics.median(ms[label])
        rows.append([*label, med, flop / med / 1e9, statistics.median(ratios),
                     f"[{min(ratios):.3f}, {max(ratios):.3f}]"])
    print_table(["A x B", "accum", "ms", "TFLOP/s", "x bf16", "x bf16 [min, max]"], rows,
                f"gemm_nt {S}^3, bf16 out, on {torch.cuda.get_device_name()} (medians of {args.rounds} "
                "interleaved rounds; x bf16 per round)")


if __name__ == "__main__":
    main()
