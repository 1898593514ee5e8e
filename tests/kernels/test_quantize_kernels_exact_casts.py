"""The MXFP8 / NVFP4 (and batched per-tensor FP8) Triton quantize kernels under the Triton
interpreter, on CPU (CI).

Not marked ``gpu``: runs wherever Triton is installed. ``TRITON_INTERPRET=1`` must be set
before the kernels are defined, so each check runs in a subprocess of its own.

The interpreter's fp32 → fp8 cast does not round like the GPU's ``cvt.rn.satfinite``
(ties, and carries into the exponent), so the inputs are built so that every fp8 cast is
exact (values with few mantissa bits, global scales that are powers of two); then the
kernels must be bitwise equal to the reference — every scale byte, FP8 byte and FP4
code, for every tile config of ``quant_tiles`` and every direction set. Stochastic
rounding is compared with the reference fed the kernels' Philox stream (modelled in torch:
``tests/_nvfp4_sr_stream.py``): bitwise. The bitwise GPU comparison on
random data is ``tests/kernels/test_quantize_kernels.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests._helpers import run_under_triton_interpreter
from tests._tiers import slow

pytestmark = slow  # minutes of interpreted kernels on two cores: the slow tier

DIRS = [(True, True), (True, False), (False, True)]


def _mant(shape, bits, gen):
    return 1.0 + torch.randint(0, 2**bits, shape, generator=gen).float() / 2**bits


def _sign(shape, gen):
    return torch.randint(0, 2, shape, generator=gen).float() * 2 - 1


def mxfp8_input(shape, bits, gen):
    """Values ``±1.m · 2^E`` (``bits`` mantissa bits, E spread over 8 binades by row):
    every scaled value is an exact normal fp8."""
    m, k = shape
    e = torch.randint(-3, 4, (m, 1), generator=gen) + torch.randint(-2, 1, shape, generator=gen)
    x = _sign(shape, gen) * _mant(shape, bits, gen) * torch.exp2(e.float())
    x[:32, :32] = 0.0  # a zero block in both directions
    return x.bfloat16()


def nvfp4_input(shape, gen):
    """``±6 · 1.mmm · 2^E``: with global scale 1 every block scale ``amax / 6`` is exact E4M3."""
    e = torch.randint(-3, 6, (shape[0], 1), generator=gen) + torch.randint(-2, 1, shape, generator=gen)
    x = 6.0 * _sign(shape, gen) * _mant(shape, 3, gen) * torch.exp2(e.float())
    x[:16, :16] = 0.0
    x[:16, :5], x[20, 40] = -0.0, -0.0  # negative zeros: code 0x8 (the input's sign bit)
    return x.bfloat16()


def nvfp4_rht_input(shape, seed, gen):
    """``x = Tᵀ y`` per 16-group along M with one non-zero ``y`` per group and column,
    ``|y| = 6 · E4M3`` and ``max |y| = 2688``: ``y`` (kernel and reference) is exact, the
    columnwise global scale is 1 and the rowwise one 1/4."""
    from hybrid_dist.formats.numerics import hadamard16

    m, k = shape
    t = hadamard16(seed)
    y = torch.zeros(m // 16, 16, k)
    pos = torch.randint(0, 16, (m // 16, k), generator=gen)
    e = torch.randint(-3, 6, (m // 16, k), generator=gen).float()
    c = 6.0 * _sign((m // 16, k), gen) * _mant((m // 16, k), 3, gen) * torch.exp2(e)
    c[0, 0] = 2688.0
    y.scatter_(1, pos[:, None, :], c[:, None, :])
    x = torch.einsum("pq,gpk->gqk", t, y).reshape(m, k)
    return x.bfloat16()


def _bits_equal(a, b, what):
    assert (a is None) == (b is None), what
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    n = int((a.reshape(-1).contiguous().view(torch.uint8) != b.reshape(-1).contiguous().view(torch.uint8)).sum())
    assert n == 0, f"{what}: {n} bytes differ"


def _storages_equal(k, r, what):
    assert (k is None) == (r is None), f"{what}: one direction missing"
    if r is None:
        return
    assert k.same_meta(r), f"{what}: metadata differs"
    for f in r.TENSOR_FIELDS:
        _bits_equal(getattr(k, f), getattr(r, f), f"{what}.{f}")


def _check_mxfp8():
    import hybrid_dist as hd
    from hybrid_dist.kernels import mxfp8, mxfp8_v1
    from hybrid_dist.kernels.quant_tiles import MXFP8_SWEEP, MXFP8_WORDS_SWEEP
    from hybrid_dist.formats.mxfp8 import mxfp8_quantize_rows

    gen = torch.Generator().manual_seed(0)
    for dtype, bits in ((torch.float8_e4m3fn, 3), (torch.float8_e5m2, 2)):
        x = mxfp8_input((96, 160), bits, gen)  # K = 160: a partial K tile at every config
        ref = (*mxfp8_quantize_rows(x, dtype), *mxfp8_quantize_rows(x.t(), dtype))
        outs = {f"row sets {cfg.label()}": mxfp8.mxfp8_quantize_tiles(x, dtype, True, True, cfg, words=False)
                for cfg in MXFP8_SWEEP[:2]}
        for cfg in MXFP8_WORDS_SWEEP[:3]:  # scales unstaged in one launch (K % 64 == 0) or not (K = 160)
            for xi, what in ((x, "96x160"), (x[:, :128], "96x128 view")):
                r = (*mxfp8_quantize_rows(xi, dtype), *mxfp8_quantize_rows(xi.t(), dtype))
                for name, a, b in zip(("row", "row_scale", "col", "col_scale"),
                                      mxfp8.mxfp8_quantize_tiles(xi, dtype, True, True, cfg, words=True), r):
                    _bits_equal(a, b, f"mxfp8 words {cfg.label()} {dtype} {what} {name}")
        outs["v1 (the previous kernel)"] = mxfp8_v1.mxfp8_quantize_v1(x, dtype, True, True)
        for label, out in outs.items():
            for name, a, b in zip(("row", "row_scale", "col", "col_scale"), out, ref):
                _bits_equal(a, b, f"mxfp8 {dtype} {label} {name}")
        q = hd.MXFP8Quantizer(dtype=dtype)
        for rw, cw in DIRS:  # the registry entry point with the tile kernel
            k = mxfp8.quantize_mxfp8(q, x, rowwise=rw, columnwise=cw, state=None, amax=None, config=MXFP8_SWEEP[0])
            r = q._quantize_2d(x, rowwise=rw, columnwise=cw, state=None, amax=None)
            _storages_equal(k[0], r[0], f"mxfp8 {dtype} dirs={rw, cw} row")
            _storages_equal(k[1], r[1], f"mxfp8 {dtype} dirs={rw, cw} col")
        # rowwise only: M not a multiple of 32 (masked rows); fp32 input (general E8M0 helpers)
        for xi, what in ((x[:40], "40 rows"), (x.float(), "fp32 input")):
            out = mxfp8.mxfp8_quantize_tiles(xi, dtype, True, False, MXFP8_SWEEP[0])
            for name, a, b in zip(("row", "row_scale"), out, mxfp8_quantize_rows(xi, dtype)):
                _bits_equal(a, b, f"mxfp8 {dtype} rowwise {what} {name}")


def _check_e8m0_bf16_helpers():
    """``e8m0_rceil_bf16`` / ``e8m0_inv_bf16`` equal ``e8m0_rceil`` / ``exp2_int(127 - e)`` on
    every non-negative bf16 amax (all 2**15 bit patterns, inf and NaN included)."""
    import triton

    from tests._triton_probes import e8m0_probe

    amax = (torch.arange(0, 2**15, dtype=torch.int32) << 16).view(torch.float32)
    n = amax.numel()
    for e5m2 in (False, True):
        out = torch.empty(4 * n, dtype=torch.int32)
        e8m0_probe[(triton.cdiv(n, 1024),)](amax, out, n, E5M2=e5m2, BLOCK=1024)
        what = f"e8m0 bf16 helpers (E5M2={e5m2})"
        assert torch.equal(out[:n], out[n:2 * n]), f"{what}: codes differ at {(out[:n] != out[n:2 * n]).sum()} amax"
        assert torch.equal(out[2 * n:3 * n], out[3 * n:]), f"{what}: multipliers differ"


def _check_nvfp4_reference():
    import hybrid_dist as hd
    from hybrid_dist.kernels import nvfp4
    from hybrid_dist.kernels.quant_tiles import NVFP4_SWEEP

    gen = torch.Generator().manual_seed(1)
    amax = torch.tensor(2688.0)
    for shape in ((96, 160), (128, 256)):  # partial tiles; whole tiles (the words kernel's EVEN)
        x = nvfp4_input(shape, gen)
        for block_2d in (False, True):
            q = hd.NVFP4Quantizer(block_2d=block_2d)
            for rw, cw in DIRS:
                k = nvfp4.quantize_nvfp4(q, x, rowwise=rw, columnwise=cw, state=None, amax=amax)
                r = q._quantize_2d(x, rowwise=rw, columnwise=cw, state=None, amax=amax)
                _storages_equal(k[0], r[0], f"nvfp4 {shape} 2d={block_2d} dirs={rw, cw} row")
                _storages_equal(k[1], r[1], f"nvfp4 {shape} 2d={block_2d} dirs={rw, cw} col")
    xr = nvfp4_rht_input((64, 96), 5, gen)
    for block_2d in (False, True):
        q = hd.NVFP4Quantizer(rht=True, rht_seed=5, block_2d=block_2d)
        r = q._quantize_2d(xr, rowwise=True, columnwise=True, state=None, amax=None)
        assert float(r[1].global_scale) == 1.0 and float(r[0].global_scale) == 0.25
        for cfg in NVFP4_SWEEP[:2]:
            k = nvfp4.quantize_nvfp4(q, xr, rowwise=True, columnwise=True, state=None, amax=None, config=cfg)
            _storages_equal(k[0], r[0], f"nvfp4 rht 2d={block_2d} {cfg.label()} row")
            _storages_equal(k[1], r[1], f"nvfp4 rht 2d={block_2d} {cfg.label()} col")


def _check_nvfp4_rht_words_vs_tile():
    """The words kernel's RHT (signs in the unpacking, unscaled butterflies, block amax from
    the last stage's pairs, signs from the transformed bits: ``kernels._rht_words``) is
    bitwise the tile kernel's ``T x`` on random bf16 with tiny values (products and sums
    below ``2**-126``) and zeros (interpreter: IEEE fp32 without flushing; bf16 subnormal
    inputs are left out: the interpreter's bf16 → fp32 cast flushes them, the GPU's does not),
    two tile configs, row+col and columnwise only, whole and partial tiles; with stochastic
    rounding of one direction too (the tile kernel's Philox stream)."""
    from hybrid_dist.formats.numerics import hadamard16
    from hybrid_dist.kernels.quant_tiles import NVFP4_SWEEP, nvfp4_words_default

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(128, 256, generator=gen) * torch.exp2(torch.randint(-20, 20, (128, 1), generator=gen).float())
    x[:16, :8] *= 2.0**-120  # tiny normal bf16: the tile kernel's products x/4 and sums are subnormal
    x[16:32, 8:16] = 2.0**-126 * torch.randint(-3, 4, (16, 8), generator=gen) * (1 + torch.rand(16, 8, generator=gen))
    x[40, :4], x[50, 100] = -0.0, -0.0
    x = x.bfloat16()
    t = hadamard16(7)[0].contiguous()
    seed = torch.zeros(1, dtype=torch.int64)
    for xs in (x, x[:96, :160].contiguous()):  # whole tiles (the words kernel's EVEN) and partial ones
        _rht_words_vs_tile(xs, t, seed, (NVFP4_SWEEP[0], nvfp4_words_default(True, True)))
    # stochastic rounding (the tile kernel's Philox stream), ordinary values; also rowwise only
    xn = (torch.randn(128, 256, generator=gen) * 3).bfloat16()
    sr_seed = torch.tensor([(5 << 32) + 77])
    for xs in (xn, xn[:96, :160].contiguous()):
        _rht_words_vs_tile(xs, t, sr_seed, (NVFP4_SWEEP[0], nvfp4_words_default(True, True, True)), sr=True)


def _rht_words_vs_tile(x, t, seed, configs, sr=False):
    from hybrid_dist.kernels.nvfp4 import nvfp4_amax_tiles, nvfp4_quantize_tiles

    amax = nvfp4_amax_tiles(x, t, True, out=torch.zeros(2))
    cases = (((False, True, True), (True, False, False), (True, False, True)) if sr
             else ((True, True, True), (False, True, True)))
    for cfg in configs:
        for rw, cw, rht in cases:
            w = nvfp4_quantize_tiles(x, t, amax, seed, rw, cw, False, rht, sr, 1, config=cfg, words=True)
            ti = nvfp4_quantize_tiles(x, t, amax, seed, rw, cw, False, rht, sr, 1, words=False)
            for name, a, b in zip(("row", "row scales", "col", "col scales", "row gs", "col gs"), w, ti):
                _bits_equal(a, b, f"nvfp4 words vs tile {tuple(x.shape)} {cfg.label()} rht={rht} sr={sr} "
                                  f"dirs={rw, cw} {name}")
            if sr and rw:  # the noise is drawn: rounding to nearest gives other codes
                rne = nvfp4_quantize_tiles(x, t, amax, seed, rw, cw, False, rht, False, 1, config=cfg, words=True)
                assert not torch.equal(w[0], rne[0]), f"nvfp4 words sr {cfg.label()}: rowwise codes are RNE's"


def _check_nvfp4_sr_stream():
    """Stochastic rounding: bitwise the reference fed the kernels' Philox stream
    (``tests/_nvfp4_sr_stream``), 1D and 2D blocks, with and without RHT, every direction set,
    two tile configs, partial and whole tiles, a seed with a non-zero high word."""
    from hybrid_dist.kernels import nvfp4
    from hybrid_dist.kernels.quant_tiles import NVFP4_SWEEP
    from tests._nvfp4_sr_stream import KernelStreamNVFP4, fixed_kernel_seed

    gen = torch.Generator().manual_seed(2)
    seed = (5 << 32) + 77
    x, amax = nvfp4_input((96, 160), gen), torch.tensor(2688.0)
    xr = nvfp4_rht_input((64, 96), 5, gen)
    xe, xre = nvfp4_input((128, 256), gen), nvfp4_rht_input((128, 256), 5, gen)  # whole tiles (EVEN)
    for block_2d in (False, True):
        q = KernelStreamNVFP4(stochastic_rounding=True, block_2d=block_2d, kernel_seed=seed)
        qr = KernelStreamNVFP4(stochastic_rounding=True, rht=True, rht_seed=5, block_2d=block_2d, kernel_seed=seed)
        cases = [(q, x, amax, rw, cw) for rw, cw in DIRS] + [(qr, xr, None, True, True)]
        cases += [(q, xe, amax, True, True), (qr, xre, None, True, True)]
        for cfg in NVFP4_SWEEP[:2]:
            for qi, xi, am, rw, cw in cases:
                with fixed_kernel_seed(seed):
                    k = nvfp4.quantize_nvfp4(qi, xi, rowwise=rw, columnwise=cw, state=None, amax=am, config=cfg)
                r = qi._quantize_2d(xi, rowwise=rw, columnwise=cw, state=None, amax=am)
                what = f"nvfp4 sr rht={qi.rht} 2d={block_2d} {cfg.label()} dirs={rw, cw}"
                _storages_equal(k[0], r[0], f"{what} row")
                _storages_equal(k[1], r[1], f"{what} col")


def _check_fp8_batched():
    """The batched per-tensor FP8 kernel (one amax and scale per matrix) against the 2D
    kernel run per matrix (same interpreter casts on both sides: bitwise) and the scales
    against the reference quantizer (fp32 arithmetic: exact here too)."""
    import hybrid_dist as hd
    from hybrid_dist.kernels import fp8_tensor

    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 72, 200, generator=gen) * torch.tensor([0.5, 4.0, 1e-3])[:, None, None]).bfloat16()
    x[1] = 0.0  # an all-zero matrix: scale 1
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        q = hd.Float8Quantizer(dtype=dtype)
        for columnwise in (True, False):
            row, col, scale_inv = fp8_tensor.quantize_fp8_batched(q, x, columnwise=columnwise)
            assert (col is None) != columnwise
            for b in range(x.shape[0]):
                k_row, k_col = fp8_tensor.quantize_fp8_tensor(q, x[b], rowwise=True, columnwise=True, state=None,
                                                              amax=None)
                what = f"fp8 batched {dtype} matrix {b} columnwise={columnwise}"
                _bits_equal(row[b], k_row.data, f"{what} row")
                if columnwise:
                    _bits_equal(col[b], k_col.data, f"{what} col")
                _bits_equal(scale_inv[b], k_row.scale_inv, f"{what} scale_inv")
                r_row, _ = q._quantize_2d(x[b], rowwise=True, columnwise=False, state=None, amax=None)
                _bits_equal(scale_inv[b], r_row.scale_inv.float(), f"{what} scale_inv vs reference")


def _check_fp8_batched_delayed():
    """Delayed scaling through the batched kernel: matrix b cast with state b's scale, its amax
    recorded into state b's history (running max over two calls), equal to the 2D kernel run
    per matrix on copies of the states; the stacked advance equals each state's torch advance."""
    import copy

    import hybrid_dist as hd
    from hybrid_dist.formats.float8 import advance_stacked
    from hybrid_dist.kernels import fp8_tensor

    gen = torch.Generator().manual_seed(4)
    q = hd.Float8Quantizer(scaling="delayed", amax_history_len=4)
    states = [q.make_state() for _ in range(3)]
    for i, st in enumerate(states):
        st.scale.fill_(2.0 ** (i - 1))
        st.amax_history[1:] = torch.tensor([1.0, 5.0, 0.5]) * (i + 1)
    ref = copy.deepcopy(states)
    for step in range(2):
        x = (torch.randn(3, 72, 200, generator=gen) * torch.tensor([0.5, 4.0, 1e-3])[:, None, None]).bfloat16()
        row, col, scale_inv = fp8_tensor.quantize_fp8_batched(q, x, states=states)
        for b in range(3):
            k_row, k_col = fp8_tensor.quantize_fp8_tensor(q, x[b], rowwise=True, columnwise=True, state=ref[b],
                                                          amax=None)
            what = f"fp8 batched delayed step {step} matrix {b}"
            _bits_equal(row[b], k_row.data, f"{what} row")
            _bits_equal(col[b], k_col.data, f"{what} col")
            _bits_equal(scale_inv[b], k_row.scale_inv, f"{what} scale_inv")
            _bits_equal(states[b].amax_history, ref[b].amax_history, f"{what} history")
    advance_stacked(states, q)
    for b in range(3):
        ref[b].advance_reference(q)
        _bits_equal(states[b].scale, ref[b].scale, f"stacked advance scale {b}")
        _bits_equal(states[b].amax_history, ref[b].amax_history, f"stacked advance history {b}")


def _check_nvfp4_empty():
    """Empty inputs (a zero-token expert): the kernel still writes the global scales (1, as
    the reference's for amax 0) and returns empty data of the right shapes."""
    import hybrid_dist as hd
    from hybrid_dist.kernels import nvfp4

    for shape in ((0, 128), (64, 0)):
        x = torch.zeros(shape).bfloat16()
        for q in (hd.NVFP4Quantizer(), hd.NVFP4Quantizer(rht=True), hd.NVFP4Quantizer(block_2d=True)):
            k = nvfp4.quantize_nvfp4(q, x, rowwise=True, columnwise=True, state=None, amax=None)
            r = q._quantize_2d(x, rowwise=True, columnwise=True, state=None, amax=None)
            for d, a, b in zip(("row", "col"), k, r):
                what = f"nvfp4 empty {shape} {q} {d}"
                assert a.data.shape == b.data.shape, what
                _bits_equal(a.global_scale, b.global_scale.reshape(a.global_scale.shape), f"{what} global scale")


def _check_fp8_current_compiled():
    """The compiled current-scaling path (amax as traced torch ops, fused by inductor into the
    producer; the non-mutating cast op) is bitwise the eager kernels' (both directions and
    ``scale_inv``), with no graph break, under ``aot_eager`` and inductor."""
    from torch._dynamo.utils import counters

    from hybrid_dist.formats.float8 import Float8Quantizer
    from hybrid_dist.kernels import fp8_tensor

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn((128, 256), generator=gen) * 3).bfloat16()
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        q = Float8Quantizer(dtype=dtype)

        def quantize(x):
            y = -torch.nn.functional.silu(x.float()).bfloat16()  # a producer; its largest |y| is negative
            row, col = fp8_tensor.quantize_fp8_tensor(q, y, rowwise=True, columnwise=True, state=None, amax=None)
            return row.data, col.data, row.scale_inv

        eager = quantize(x)
        for backend in ("aot_eager", "inductor"):
            torch._dynamo.reset()
            counters.clear()
            got = torch.compile(quantize, backend=backend, fullgraph=True)(x)
            assert not counters["graph_break"], dict(counters["graph_break"])
            for name, a, b in zip(("row", "col", "scale_inv"), got, eager):
                _bits_equal(a, b, f"compiled ({backend}) fp8 current {dtype} {name}")


CHECKS = ("fp8_current_compiled", "nvfp4_empty", "fp8_batched", "fp8_batched_delayed", "mxfp8", "e8m0_bf16_helpers", "nvfp4_reference",
          "nvfp4_sr_stream", "nvfp4_rht_words_vs_tile")


@pytest.mark.parametrize("check", CHECKS)
def test_kernels_under_triton_interpreter(check):
    # one subprocess per check: xdist spreads them over the cores, each has its own timeout
    run_under_triton_interpreter(f"from tests.kernels.test_quantize_kernels_exact_casts import _check_{check} as c\n"
                                 f"c()\nprint('{check} passed')", done=f"{check} passed")
