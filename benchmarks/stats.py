"""``inspection.quant_stats`` of one operand direction: the fused CUDA kernel
(``kernels.stats``, ``fused=True``) against the torch ops it replaces (``fused=False``),
per format and direction, on one tensor, with and without the high-precision reference.

    python -m benchmarks.stats [--shape 8192 14336]

ms of ``quant_stats`` (each path with its own block-scale histogram and, with a reference,
the RHT domain where the format has one) and the fused path's bytes read per ms (the reference,
the codes and the scales once: GB/s to set against the copy bandwidth printed in the
title). Each row's fused vector is checked against the torch one first.
"""

from __future__ import annotations

import argparse
import math

import torch

from benchmarks._bench import bench_ms, copy_gbps, print_table
from hybrid_dist.formats import Float8Quantizer, MXFP8Quantizer, NVFP4Quantizer
from hybrid_dist.inspection.stats import FIELDS, quant_stats

CASES = {"fp8_e4m3": Float8Quantizer(), "mxfp8": MXFP8Quantizer(), "nvfp4": NVFP4Quantizer(),
         "nvfp4_rht": NVFP4Quantizer(rht=True)}
NORMS = [FIELDS.index("signal_norm"), FIELDS.index("noise_norm")]


def _check(ref: torch.Tensor, got: torch.Tensor, what: str) -> None:
    """Bitwise but for the norms (1e-5 relative), NaN in the same places."""
    ref, got = ref.cpu(), got.cpu()
    exact = [i for i in range(ref.numel()) if i not in NORMS]
    if not (torch.equal(ref.isnan(), got.isnan()) and torch.equal(ref[exact].nan_to_num(), got[exact].nan_to_num())
            and all(math.isnan(ref[i]) or math.isclose(ref[i], got[i], rel_tol=1e-5) for i in NORMS)):
        raise AssertionError(f"{what}: fused {got[:len(FIELDS)].tolist()} != torch {ref[:len(FIELDS)].tolist()}")


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
            for ref_x in (x, None):
                what = f"{name} {direction}" + ("" if ref_x is not None else " (no reference)")
                _check(quant_stats(ref_x, st, fused=False), quant_stats(ref_x, st, fused=True), what)
                t_ms = bench_ms(lambda: quant_stats(ref_x, st, fused=False))
                f_ms = bench_ms(lambda: quant_stats(ref_x, st, fused=True))
                nbytes = st.nbytes() + (x.numel() * x.element_size() if ref_x is not None else 0)
                rows.append([what, t_ms, f_ms, t_ms / f_ms, nbytes / f_ms / 1e6])
    print_table(["format, direction", "torch ms", "fused ms", "speedup", "fused GB/s"], rows,
                f"quant_stats of {tuple(args.shape)} bf16 on {torch.cuda.get_device_name()} "
                f"(copy: {copy_gbps():.0f} GB/s)")


if __name__ == "__main__":
    main()
