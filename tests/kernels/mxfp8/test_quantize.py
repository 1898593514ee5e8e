"""The MXFP8 quantize kernels (``kernels.mxfp8``: the 32-row-set kernel, which also serves
rowwise only, and the words kernel) against the reference: bitwise on the GPU at every tile
config, and under the Triton interpreter (CPU, the slow tier) on inputs whose casts are exact;
the words kernel refuses what it cannot read (host side).
"""

from __future__ import annotations

import pytest
import torch

from tests._helpers import run_check_under_triton_interpreter
from tests._tiers import slow

import hybrid_dist as hd
from hybrid_dist.kernels.mxfp8.configs import MXFP8_SWEEP, MXFP8_WORDS_SWEEP
from tests.kernels._quantize_checks import (DIRS, E4M3, E5M2, SHAPES, bits_equal, check_bitwise, make_x, mxfp8_input,
                                          storages_equal, unaligned)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES + [(96, 160)], ids=str)
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=str)
def test_mxfp8_bitwise(shape, dtype):
    q = hd.MXFP8Quantizer(dtype=dtype)
    x = make_x(shape)
    x[3, 40] = 1e-30  # tiny amax: subnormal E8M0 ratio path
    for rw, cw in DIRS:
        check_bitwise(q, x, rw, cw, f"mxfp8 {dtype} {shape} dirs={rw, cw}")
    check_bitwise(q, make_x(shape, dtype=torch.float32), True, True, f"mxfp8 fp32 input {shape}")


MXFP8_KERNEL_CONFIGS = [("words", c) for c in MXFP8_WORDS_SWEEP] + [("row sets", c) for c in MXFP8_SWEEP]


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,cfg", MXFP8_KERNEL_CONFIGS, ids=lambda v: v if isinstance(v, str) else v.label())
def test_mxfp8_tile_configs_bitwise(kernel, cfg):
    """Both columnwise kernels at every tile config: word-aligned bf16 takes ``mxfp8.words``,
    a 2-byte aligned view the 32-row-set kernel (which also takes rowwise alone). Shapes with
    partial tiles along M and K."""
    dirs = DIRS if kernel == "row sets" else [(True, True), (False, True)]
    for dtype in (E4M3, E5M2):
        q = hd.MXFP8Quantizer(dtype=dtype)
        for shape in ((384, 640), (96, 160), (160, 96)):
            x = make_x(shape)
            x[3, 40 % shape[1]] = 1e-30
            x[37, 5], x[70, 90 % shape[1]] = float("inf"), float("-inf")
            if kernel == "row sets":
                x = unaligned(x)
            for rw, cw in dirs:
                check_bitwise(q, x, rw, cw, f"mxfp8 {kernel} {cfg.label()} {dtype} {shape} dirs={rw, cw}", config=cfg)


@pytest.mark.parametrize("case", ["fp32", "M % 32", "odd start", "rowwise only"])
def test_mxfp8_words_kernel_refuses_what_it_cannot_read(case):
    """``words=True`` on an input the MXFP8 words kernel cannot take raises before any launch."""
    pytest.importorskip("triton")  # the kernel modules import Triton (absent on CPU-only installs)
    from hybrid_dist.kernels.mxfp8.quantize import mxfp8_quantize_tiles

    x = torch.zeros(64, 64, dtype=torch.bfloat16)
    xi, rw, cw = {"fp32": (x.float(), True, True), "M % 32": (x[:40], True, True),
                  "odd start": (x[:, 1:33], False, True), "rowwise only": (x, True, False)}[case]
    with pytest.raises(ValueError, match="words kernel"):
        mxfp8_quantize_tiles(xi, torch.float8_e4m3fn, rw, cw, words=True)


def _check_mxfp8():
    import hybrid_dist as hd
    from hybrid_dist.kernels.mxfp8 import quantize as mxfp8
    from hybrid_dist.kernels.mxfp8.configs import MXFP8_SWEEP, MXFP8_WORDS_SWEEP
    from hybrid_dist.formats.mxfp8 import mxfp8_quantize_rows

    gen = torch.Generator().manual_seed(0)
    for dtype, bits in ((torch.float8_e4m3fn, 3), (torch.float8_e5m2, 2)):
        x = mxfp8_input((96, 160), bits, gen)  # K = 160: a partial K tile at every config
        ref = (*mxfp8_quantize_rows(x, dtype), *mxfp8_quantize_rows(x.t(), dtype))
        outs = {f"row sets {cfg.label()}": mxfp8.mxfp8_quantize_tiles(x, dtype, True, True, cfg, words=False)
                for cfg in MXFP8_SWEEP[:2]}
        for cfg in MXFP8_WORDS_SWEEP[:3]:  # scales unstaged in one launch (K % 64 == 0) or not (K = 160)
            x1 = mxfp8_input((128, 64), bits, gen)  # stages of one unit row (BM = 128, BK = 64): copied
            for xi, what in ((x, "96x160"), (x[:, :128], "96x128 view"), (x1, "128x64")):
                r = (*mxfp8_quantize_rows(xi, dtype), *mxfp8_quantize_rows(xi.t(), dtype))
                for name, a, b in zip(("row", "row_scale", "col", "col_scale"),
                                      mxfp8.mxfp8_quantize_tiles(xi, dtype, True, True, cfg, words=True), r):
                    bits_equal(a, b, f"mxfp8 words {cfg.label()} {dtype} {what} {name}")
        for label, out in outs.items():
            for name, a, b in zip(("row", "row_scale", "col", "col_scale"), out, ref):
                bits_equal(a, b, f"mxfp8 {dtype} {label} {name}")
        q = hd.MXFP8Quantizer(dtype=dtype)
        for rw, cw in DIRS:  # the registry entry point with the tile kernel
            k = mxfp8.quantize_mxfp8(q, x, rowwise=rw, columnwise=cw, state=None, amax=None, config=MXFP8_SWEEP[0])
            r = q._quantize_2d(x, rowwise=rw, columnwise=cw, state=None, amax=None)
            storages_equal(k[0], r[0], f"mxfp8 {dtype} dirs={rw, cw} row")
            storages_equal(k[1], r[1], f"mxfp8 {dtype} dirs={rw, cw} col")
        # rowwise only: M not a multiple of 32 (masked rows); fp32 input (general E8M0 helpers)
        for xi, what in ((x[:40], "40 rows"), (x.float(), "fp32 input")):
            out = mxfp8.mxfp8_quantize_tiles(xi, dtype, True, False, MXFP8_SWEEP[0])
            for name, a, b in zip(("row", "row_scale"), out, mxfp8_quantize_rows(xi, dtype)):
                bits_equal(a, b, f"mxfp8 {dtype} rowwise {what} {name}")
        # rowwise only through the operator (the dispatcher call; it takes the 32-row-set kernel)
        for xi, what in ((x, "96x160"), (x[:40], "40 rows"), (x.float(), "fp32 input")):
            out = mxfp8.mxfp8_quantize_op(xi, dtype, True, False)
            for name, a, b in zip(("row", "row_scale"), out, mxfp8_quantize_rows(xi, dtype)):
                bits_equal(a, b, f"mxfp8 op {dtype} rowwise {what} {name}")
            assert out[2].numel() == 0 and out[3].numel() == 0, f"mxfp8 op {dtype} rowwise {what}: columnwise made"


CHECKS = ('mxfp8',)


@slow  # minutes of interpreted kernels on two cores: the slow tier
@pytest.mark.parametrize("check", CHECKS)
def test_mxfp8_under_triton_interpreter(check):
    run_check_under_triton_interpreter("tests.kernels.mxfp8.test_quantize", check)
