"""Quantize kernels: GB/s (bytes read + written) per format and direction set at
16384×8192 bf16, against a device copy measured in the same run. Prints one table.

Bytes counted: the input read once plus every output byte written (the fewest a fused
kernel must move); formats with a per-tensor current amax read the input a second time,
which is counted too (``reads`` column). Run: ``python -m benchmarks.quantize``.

``--fast-paths``: each kept fast path (the MXFP8 and NVFP4 words kernels) against the
general kernel of its format on the same input, medians of interleaved rounds, and whether
the outputs are bitwise equal (they must be).

``--sweep``: one table of the MXFP8 / NVFP4 fused passes per tile config of
``kernels.mxfp8.configs`` and ``kernels.nvfp4.configs``, each pass timed alone (NVFP4 with
precomputed global scales; the amax pass in its own rows). ``differs`` = bytes of the
outputs that differ from the first row of the case (MXFP8: the 32-row-set kernel at the first
config of ``MXFP8_SWEEP``; NVFP4: the tile kernel at its default config): 0 expected.
"""

from __future__ import annotations

import argparse

import torch

import hybrid_dist as hd
from benchmarks._bench import bench_ms, bytes_equal, copy_gbps, interleaved_ms, print_table

M, K = 16384, 8192
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

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

NVFP4_SWEEP_CASES = [  # (name, rht, stochastic rounding, block rows)
    ("nvfp4 1d", False, False, 1),
    ("nvfp4 2d", False, False, 16),
    ("nvfp4 rht", True, False, 1),
    ("nvfp4 rht+sr", True, True, 1),
]


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _n_differ(a, b) -> int:
    return sum(int((x.contiguous().view(torch.uint8) != y.contiguous().view(torch.uint8)).sum())
               for x, y in zip(a, b))


def _row(name, label, fn, ref_out, copy):
    out = fn()
    ms = bench_ms(fn)
    gbps = (M * K * 2 + _nbytes(out)) / ms / 1e6
    differs = "" if ref_out is None else _n_differ(out, ref_out)
    return [name, label, ms, gbps, gbps / copy, differs]


def _sweep_mxfp8(x, copy) -> list[list]:
    from hybrid_dist.kernels.mxfp8.configs import MXFP8_SWEEP, MXFP8_WORDS_SWEEP
    from hybrid_dist.kernels.mxfp8.quantize import mxfp8_quantize_tiles

    base = mxfp8_quantize_tiles(x, E4M3, True, True, MXFP8_SWEEP[0], words=False)
    rows = []
    for words, sweep in ((False, MXFP8_SWEEP), (True, MXFP8_WORDS_SWEEP)):
        for cfg in sweep:
            label = f"{'words' if words else 'row sets'} {cfg.label()}"
            rows.append(_row("mxfp8 row+col", label, lambda cfg=cfg, w=words: mxfp8_quantize_tiles(
                x, E4M3, True, True, cfg, words=w), base, copy))
    return rows


def _sweep_nvfp4(x, copy) -> list[list]:
    from hybrid_dist.kernels.nvfp4.configs import NVFP4_SWEEP, nvfp4_default
    from hybrid_dist.kernels.nvfp4.quantize import _rht_row, nvfp4_amax_tiles, nvfp4_quantize_tiles

    t = _rht_row(0, x.device)
    amax = x.float().abs().amax().repeat(2)
    seed = torch.tensor([1234], dtype=torch.int64, device=x.device)
    rows = []
    for name, rht, sr, br in NVFP4_SWEEP_CASES:
        derive = br == 16 and not rht
        args = (True, True, derive, rht, sr, br)
        base = nvfp4_quantize_tiles(x, t, amax, seed, *args, nvfp4_default(br), words=False)[:4]
        for cfg in NVFP4_SWEEP:
            rows.append(_row(f"{name} row+col", cfg.label(),
                             lambda a=args, cfg=cfg: nvfp4_quantize_tiles(x, t, amax, seed, *a, cfg)[:4], base, copy))
    for rht in (False, True):
        rows.append(_row(f"nvfp4 amax pass{' +rht' if rht else ''}", "64x128/w4",
                         lambda r=rht: (nvfp4_amax_tiles(x, t, r),), None, copy))
    return rows


def sweep(mxfp8_only: bool = False) -> None:
    x = torch.randn(M, K, device="cuda").bfloat16()
    copy = copy_gbps(M * K)
    rows = [["device copy", "", "", copy, 1.0, ""]]
    rows += _sweep_mxfp8(x, copy)
    if not mxfp8_only:
        rows += _sweep_nvfp4(x, copy)
    dev = torch.cuda.get_device_name()
    print_table(["kernel pass", "tile config", "ms", "GB/s", "x copy", "differs"], rows,
                f"quantize tile sweep {M}x{K} bf16 on {dev} (one pass each; GB/s = input once + outputs)")


FAST_PATH_ROUNDS = 7
NVFP4_WORDS_CASES = [  # (case, rowwise, columnwise, rht, stochastic rounding): where the words kernel applies
    ("1x16 row+col", True, True, False, False),
    ("1x16 row only", True, False, False, False),
    ("1x16 col only", False, True, False, False),
    ("1x16 row+col, col RHT", True, True, True, False),
    ("1x16 col only RHT", False, True, True, False),
    ("1x16 row only SR", True, False, False, True),
    ("1x16 col only RHT+SR", False, True, True, True),
]


def fast_path_cases(x) -> list[tuple]:
    """``(format, case, general, fast)`` for every kept fast path on ``x``: two callables that
    return the output tensors of the general kernel of the format and of the fast path."""
    from hybrid_dist.kernels.mxfp8.quantize import mxfp8_quantize_tiles
    from hybrid_dist.kernels.nvfp4.quantize import _rht_row, nvfp4_amax_tiles, nvfp4_quantize_tiles

    cases = []
    for case, rw, cw in (("row+col", True, True), ("col only", False, True)):
        cases.append(("mxfp8", f"{case}: words kernel",
                      lambda rw=rw, cw=cw: mxfp8_quantize_tiles(x, E4M3, rw, cw, words=False),
                      lambda rw=rw, cw=cw: mxfp8_quantize_tiles(x, E4M3, rw, cw, words=True)))
    t = _rht_row(0, x.device)
    amax = nvfp4_amax_tiles(x, t, True).clone()
    seed = torch.tensor([1234], dtype=torch.int64, device=x.device)
    for case, rw, cw, rht, sr in NVFP4_WORDS_CASES:
        args = (x, t, amax, seed, rw, cw, False, rht, sr, 1)
        cases.append(("nvfp4", f"{case}: words kernel", lambda a=args: nvfp4_quantize_tiles(*a, words=False),
                      lambda a=args: nvfp4_quantize_tiles(*a, words=True)))
    return cases


def fast_path_rows(cases, rounds: int, timer=interleaved_ms) -> list[list]:
    """One row per case: ``[format, case, general ms, fast path ms, speedup, bitwise]``: the
    medians over ``rounds`` interleaved rounds (``timer``: ``interleaved_ms``'s contract), the
    speedup the median of the per-round ratios, ``bitwise`` whether every output tensor of
    the fast path equals the general kernel's byte for byte (and has its shape)."""
    fns = {}
    for i, (_, _, general, fast) in enumerate(cases):
        fns[i, "general"], fns[i, "fast"] = general, fast
    ms, errors = timer(fns, rounds)
    rows = []
    for i, (fmt, case, general, fast) in enumerate(cases):
        err = errors.get((i, "general")) or errors.get((i, "fast"))
        if err:
            rows.append([fmt, case, err, "", "", ""])
            continue
        g, f = general(), fast()
        same = len(g) == len(f) and all(a.shape == b.shape for a, b in zip(g, f)) and bytes_equal(g, f)
        ratios = [a / b for a, b in zip(ms[i, "general"], ms[i, "fast"])]
        rows.append([fmt, case, _median(ms[i, "general"]), _median(ms[i, "fast"]), _median(ratios),
                     "yes" if same else "NO"])
    return rows


def _median(v: list[float]) -> float:
    v = sorted(v)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def fast_paths(rounds: int = FAST_PATH_ROUNDS) -> None:
    x = torch.randn(M, K, device="cuda").bfloat16()
    rows = fast_path_rows(fast_path_cases(x), rounds)
    dev = torch.cuda.get_device_name()
    print_table(["format", "case", "general ms", "fast path ms", "speedup", "bitwise"], rows,
                f"quantize fast paths against the general kernel, {M}x{K} bf16 on {dev} "
                f"(medians of {rounds} interleaved rounds)")


def _sass_row(fn, signature, constexprs, cfg, name):
    import os
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(i,): [["tt.divisibility", 16]] for i, (arg, ty) in enumerate(signature.items())
             if ty.startswith("*") or arg in ("M", "K", "stride_m")}  # as a launch specializes them
    tile = {k: v for k, v in (("BM", cfg.bm), ("BK", cfg.bk)) if k in signature}
    src = ASTSource(fn=fn, signature=signature, constexprs={**constexprs, **tile}, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg.num_warps})
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True).stdout
    n = len(re.findall(r"^\s+/\*[0-9a-f]{4,6}\*/\s+\S", sass, re.M))
    regs = re.search(r"REG:(\d+)", usage)
    spill = re.search(r"LOCAL:(\d+)", usage)
    return [name, cfg.label(), regs.group(1) if regs else "?", spill.group(1) if spill else "?",
            n * 32 * cfg.num_warps / (cfg.bm * cfg.bk)]


def sass() -> None:
    from hybrid_dist.kernels.mxfp8.configs import MXFP8_SWEEP
    from hybrid_dist.kernels.mxfp8.quantize import _mxfp8_kernel
    from hybrid_dist.kernels.nvfp4.configs import NVFP4_SWEEP
    from hybrid_dist.kernels.nvfp4.tiles import nvfp4_quantize_kernel

    i32, c = "i32", "constexpr"
    mx_sig = {"x_ptr": "*bf16", "row_ptr": "*fp8e4nv", "row_s_ptr": "*u8", "col_ptr": "*fp8e4nv", "col_s_ptr": "*u8",
              "M": i32, "K": i32, "stride_m": i32, "FMAX": c, "E5M2": c, "BF16": c, "ROW": c, "COL": c, "BK": c,
              "EVEN": c}
    nv_sig = {"x_ptr": "*bf16", "t_ptr": "*fp32", "amax_ptr": "*fp32", "seed_ptr": "*i64", "row_ptr": "*u8",
              "row_s_ptr": "*fp8e4nv", "col64_ptr": "*i64", "col_s_ptr": "*fp8e4nv", "gs_row_ptr": "*fp32",
              "gs_col_ptr": "*fp32", "M": i32, "K": i32,
              "stride_m": i32, "ROW": c, "COL": c, "DERIVE_COL": c, "RHT": c, "SR": c, "TWO_D": c, "BM": c, "BK": c,
              "EVEN": c}
    rows = [_sass_row(_mxfp8_kernel, mx_sig, {"FMAX": 448.0, "E5M2": False, "BF16": True, "ROW": True, "COL": True,
                                             "EVEN": True}, cfg,
                      "mxfp8 row+col") for cfg in MXFP8_SWEEP]
    for name, rht, sr, br in NVFP4_SWEEP_CASES:
        flags = {"ROW": True, "COL": True, "DERIVE_COL": br == 16 and not rht, "RHT": rht, "SR": sr, "TWO_D": br == 16,
                 "EVEN": br == 16}  # as nvfp4_quantize_tiles launches whole tiles
        rows += [_sass_row(nvfp4_quantize_kernel, nv_sig, flags, cfg, f"{name} row+col") for cfg in NVFP4_SWEEP]
    print_table(["kernel pass", "tile config", "regs", "local (spill) bytes", "SASS instr / element"], rows,
                "quantize kernels compiled for sm_90 (offline; thread-instructions per element of x)")


def once() -> None:
    """Each case of the table quantized once (for a profiler: ``benchmarks/ncu_summary.py``);
    ``CASE <name>`` on stderr before each."""
    import sys

    x = torch.randn(M, K, device="cuda").bfloat16()
    for name, q, rw, cw, _ in CASES:
        state = q.make_state()
        if state is not None and hasattr(state, "to"):
            state.to("cuda")
        print(f"CASE {name}", file=sys.stderr)
        q.quantize_storages(x, rowwise=rw, columnwise=cw, state=state)
    torch.cuda.synchronize()


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast-paths", action="store_true",
                        help="each fast path against its format's general kernel (time, bitwise)")
    parser.add_argument("--sweep", action="store_true", help="time every MXFP8/NVFP4 tile config")
    parser.add_argument("--mxfp8-only", action="store_true", help="with --sweep: the MXFP8 configs only")
    parser.add_argument("--sass", action="store_true", help="offline: registers and SASS size per tile config")
    parser.add_argument("--once", action="store_true", help="quantize each case once (under a profiler)")
    args = parser.parse_args()
    if args.once:
        once()
    elif args.sass:
        sass()
    elif args.fast_paths:
        fast_paths()
    elif args.sweep:
        sweep(args.mxfp8_only)
    else:
        main()
