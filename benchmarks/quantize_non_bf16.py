"""Quantize of fp32 (or fp16) inputs in both directions: the kernels against the paths they
replaced, timed in interleaved rounds in one run, outputs compared as bytes. Prints one table.

Replaced paths: FP8 blocks and NVFP4 (and NVFP4 stochastic rounding: equal only in
distribution, the reference draws from ``torch.rand``) ran the reference backend; MXFP8
quantized ``x`` and a torch transpose of it rowwise; FP8
per-tensor wrote rowwise only and torch transposed it, which fp32 still does
(``kernels.fp8.tensor``'s note on fp32 inputs), fp16 now in one fused launch.
Run: ``python -m benchmarks.quantize_non_bf16 [--dtype float16]``.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import hybrid_dist as hd
from benchmarks._bench import bytes_equal, interleaved_ms, print_table
from hybrid_dist.kernels import quantize_impl_for
from hybrid_dist.kernels.transpose import transposed

CASES = [  # (name, quantizer, former path: "transpose" or "reference")
    ("fp8 current e4m3", hd.Float8Quantizer(), "transpose"),
    ("fp8 block 1x128", hd.Float8BlockQuantizer(block="1x128"), "reference"),
    ("fp8 block 128x128", hd.Float8BlockQuantizer(block="128x128"), "reference"),
    ("mxfp8 e4m3", hd.MXFP8Quantizer(), "rowwise of x and x.T"),
    ("nvfp4 1d", hd.NVFP4Quantizer(), "reference"),
    ("nvfp4 rht+sr (grads)", hd.NVFP4Quantizer(rht=True, stochastic_rounding=True), "reference"),
]


def _flat(storages) -> list[torch.Tensor]:
    return [getattr(st, f) for st in storages if st is not None for f in st.TENSOR_FIELDS]


def _former(q, x, how):
    if how == "reference":
        return lambda: q._quantize_2d(x, rowwise=True, columnwise=True, state=None, amax=None)
    impl = quantize_impl_for(q, x)
    if how == "rowwise of x and x.T":
        def rowwise_twice():
            col = impl(q, x.t().contiguous(), rowwise=True, columnwise=False, state=None, amax=None)[0]
            return impl(q, x, rowwise=True, columnwise=False, state=None, amax=None)[0], col
        return rowwise_twice

    def row_then_transpose():
        row, _ = impl(q, x, rowwise=True, columnwise=False, state=None, amax=None)
        return row, transposed(row.data)
    return row_then_transpose


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs=2, default=(8192, 8192))
    p.add_argument("--dtype", choices=["float32", "float16"], default="float32")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    x = torch.randn(*a.shape, device="cuda").to(getattr(torch, a.dtype))
    rows = []
    for name, q, how in CASES:
        impl = quantize_impl_for(q, x)
        ours = lambda q=q, impl=impl: impl(q, x, rowwise=True, columnwise=True, state=None, amax=None)  # noqa: E731
        former = _former(q, x, how)
        ms, err = interleaved_ms({"ours": ours, "former": former}, a.rounds)
        if err:
            rows.append([name, how, err.get("ours", ""), err.get("former", ""), "", ""])
            continue
        o, f = ours(), former()
        if "sr" in name:  # the reference's own random stream
            same = None
        elif how != "transpose":
            same = bytes_equal(_flat(o), _flat(f))
        else:
            same = bytes_equal([o[0].data, o[1].data], [f[0].data, f[1]])
        ratio = statistics.median(b / m for m, b in zip(ms["ours"], ms["former"]))
        rows.append([name, how, f"{statistics.median(ms['ours']):.3f}", f"{statistics.median(ms['former']):.3f}",
                     f"**{ratio:.2f}**", {None: "n/a (SR)", True: "yes", False: "**NO**"}[same]])
    print_table(["format (row+col)", "former path", "ours ms", "former ms", "former / ours", "bytes equal"], rows,
                f"{a.dtype} input {a.shape[0]}x{a.shape[1]}, {torch.cuda.get_device_name()}, medians of "
                f"{a.rounds} interleaved rounds")


if __name__ == "__main__":
    main()
