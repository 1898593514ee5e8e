"""The NVFP4 quantize kernels (``kernels.nvfp4``: the amax pass, the tile kernel and the
dispatch to the words kernel) against the reference.

On the GPU: bitwise without RHT/SR; with RHT the kernel sums the Hadamard products in a
different order than the reference's fp32 matmul, so codes may flip where a value sits
within an ulp of a rounding boundary: bounded mismatch fraction, global scales to 1e-6.
Stochastic rounding uses a Philox stream (not torch.rand's): bitwise the reference fed that
stream (with RHT within the same bound), reproducible and unbiased. Every tile config of
``kernels.nvfp4.configs`` is tested as the default one. Under the Triton interpreter (CPU,
the slow tier): bitwise on inputs whose casts are exact, SR bitwise the reference fed the
kernels' stream, empty inputs.
"""

from __future__ import annotations

import pytest
import torch

from tests._helpers import run_check_under_triton_interpreter
from tests._tiers import slow

import hybrid_dist as hd
from hybrid_dist.kernels.nvfp4.configs import NVFP4_2D_DEFAULT, NVFP4_DEFAULT, NVFP4_SWEEP
from hybrid_dist.kernels.tile_config import bf16_words
from tests._kernel_helpers import kernel_quantize, n_bit_diffs, reference_quantize
from tests.kernels._quantize_checks import (DIRS, SHAPES, bits_equal, check_bitwise, check_rht_within_bound,
                                          check_sr_stream, make_x, nvfp4_input, nvfp4_rht_input, storages_equal,
                                          unaligned)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES + [(96, 160)], ids=str)
@pytest.mark.parametrize("block_2d", [False, True], ids=["1d", "2d"])
def test_nvfp4_rne_bitwise(shape, block_2d):
    q = hd.NVFP4Quantizer(block_2d=block_2d)
    x = make_x(shape)
    for rw, cw in DIRS:
        check_bitwise(q, x, rw, cw, f"nvfp4 2d={block_2d} {shape} dirs={rw, cw}")
    check_bitwise(q, x, True, True, f"nvfp4 amax= {shape}", amax=torch.tensor(40.0, device="cuda"))


@pytest.mark.gpu
def test_nvfp4_1d_tile_kernel_where_the_words_kernel_does_not_apply():
    """1×16 blocks from bf16 take ``nvfp4.words``; a 2-byte aligned bf16 view (all directions)
    and an fp32 input (rowwise) take the tile kernel, bitwise the reference too."""
    q = hd.NVFP4Quantizer()
    x = make_x((96 * 160 + 1, 1)).reshape(-1)[1:].view(96, 160)
    assert not bf16_words(x) and bf16_words(x.clone())
    for rw, cw in DIRS:
        check_bitwise(q, x, rw, cw, f"nvfp4 1d unaligned bf16 dirs={rw, cw}")
    check_bitwise(q, make_x((96, 160), dtype=torch.float32), True, False, "nvfp4 1d fp32 rowwise")
    check_bitwise(q, make_x((96, 160), dtype=torch.float32), True, True, "nvfp4 1d fp32 row+col")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("block_2d", [False, True], ids=["1d", "2d"])
def test_nvfp4_rht_within_bound(shape, block_2d):
    check_rht_within_bound(hd.NVFP4Quantizer(rht=True, block_2d=block_2d), make_x(shape), f"{shape} 2d={block_2d}")


@pytest.mark.gpu
def test_nvfp4_negative_zero_encodes_as_code_8():
    """``-0.0`` (in a zero block and among non-zeros) encodes as the negative zero ``0x8`` on
    every NVFP4 kernel, as the reference: the words kernel (bf16) takes the sign from the
    input's bits, the tile kernel (fp32; and 16×16 blocks) from the scaled value's."""
    for dtype in (torch.bfloat16, torch.float32):
        x = make_x((384, 640), dtype=dtype)
        x[0, :3], x[100, 17], x[101, 0] = -0.0, -0.0, -0.0
        for block_2d in (False, True):
            q = hd.NVFP4Quantizer(block_2d=block_2d)
            for rw, cw in DIRS:
                check_bitwise(q, x, rw, cw, f"nvfp4 -0.0 {dtype} 2d={block_2d} dirs={rw, cw}")
        row, col = kernel_quantize(hd.NVFP4Quantizer(), x, rowwise=True, columnwise=True)
        assert int(row.data[100, 8]) >> 4 == 0x8 and int(row.data[0, 0]) == 0x88, f"{dtype}: rowwise codes"
        assert int(col.data[17, 50]) & 0xF == 0x8 and int(col.data[0, 0]) & 0xF == 0x8, f"{dtype}: columnwise"


@pytest.mark.gpu
def test_nvfp4_stochastic_rounding_reproducible_and_unbiased():
    q = hd.NVFP4Quantizer(stochastic_rounding=True, seed=7)
    x = make_x((256, 512))
    a = kernel_quantize(q, x, rowwise=True, columnwise=True, state=q.make_state())
    b = kernel_quantize(q, x, rowwise=True, columnwise=True, state=q.make_state())
    for d in (0, 1):
        assert n_bit_diffs(a[d].data, b[d].data, "sr repro") == 0, "same seed must reproduce"
        assert n_bit_diffs(a[d].block_scale, b[d].block_scale, "sr scales") == 0
    # the block scales do not depend on the rounding: bitwise the RNE reference
    r = reference_quantize(hd.NVFP4Quantizer(), x, rowwise=True, columnwise=True)
    assert n_bit_diffs(a[0].block_scale, r[0].block_scale, "sr row scale") == 0
    st = q.make_state()
    n = 64
    mean = sum(kernel_quantize(q, x, rowwise=True, columnwise=False, state=st)[0].dequantize()
               for _ in range(n)) / n
    rtn = r[0].dequantize()
    bias_sr = ((mean - x.float()).mean() / x.float().abs().mean()).abs()
    err_sr = (mean - x.float()).norm() / x.float().norm()
    err_rtn = (rtn - x.float()).norm() / x.float().norm()
    assert bias_sr < 2e-3, f"SR mean bias {bias_sr}"
    assert err_sr < 0.5 * err_rtn, f"mean of {n} SR draws ({err_sr}) should beat one RTN ({err_rtn})"


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", NVFP4_SWEEP, ids=lambda c: c.label())
def test_nvfp4_tile_configs(cfg):
    """RNE bitwise the reference; RHT within the bound; SR bitwise the reference fed the
    kernels' stream (with RHT: within the bound). Every
    direction set for the default configs, row+col for the others (compile time)."""
    dirs = DIRS if cfg in (NVFP4_DEFAULT, NVFP4_2D_DEFAULT) else [(True, True)]
    for shape in ((384, 640), (96, 160)):
        x = make_x(shape)
        for block_2d in (False, True):
            q = hd.NVFP4Quantizer(block_2d=block_2d)
            for rw, cw in dirs:
                check_bitwise(q, x, rw, cw, f"nvfp4 {cfg.label()} 2d={block_2d} {shape} dirs={rw, cw}", config=cfg)
            check_bitwise(q, x, True, True, f"nvfp4 {cfg.label()} amax= {shape}", config=cfg,
                   amax=torch.tensor(40.0, device="cuda"))
    x = make_x((384, 640))
    for block_2d in (False, True):
        check_rht_within_bound(hd.NVFP4Quantizer(rht=True, block_2d=block_2d), x,
                                f"{cfg.label()} 2d={block_2d}", config=cfg)
        check_sr_stream(x, block_2d, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(384, 640), (96, 160), (4096, 2048)], ids=str)
def test_nvfp4_sr_stream_every_direction_set(shape):
    """Stochastic rounding at the default tile configs, every direction set (partial tiles
    along M and K at 96x160)."""
    x = make_x(shape)
    for block_2d, cfg in ((False, NVFP4_DEFAULT), (True, NVFP4_2D_DEFAULT)):
        check_sr_stream(x, block_2d, cfg, dirs=DIRS)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(384, 640), (4096, 2048)], ids=str)
def test_nvfp4_amax_pass(shape):
    from hybrid_dist.formats.numerics import apply_hadamard16, hadamard16
    from hybrid_dist.kernels.nvfp4.quantize import _rht_row, nvfp4_amax_tiles

    x = make_x(shape)
    for seed in (0, 3):
        out = nvfp4_amax_tiles(x, _rht_row(seed, x.device), True)
        assert out[0] == x.float().abs().amax(), (shape, seed)
        ref_h = apply_hadamard16(x.t().float(), hadamard16(seed, x.device)).abs().amax()
        assert torch.allclose(out[1], ref_h, rtol=1e-6, atol=0), (shape, seed, out[1], ref_h)
    assert nvfp4_amax_tiles(x, _rht_row(0, x.device), False)[1] == 0
    x[7, 9] = -3e4  # without RHT: the amax itself, from word-aligned bf16 and from a 2-byte aligned view
    for xi in (x, unaligned(x)):
        out = nvfp4_amax_tiles(xi, _rht_row(0, x.device), False)
        assert out[0] == x.float().abs().amax() and out[1] == 0, (shape, out)


def test_nvfp4_stochastic_rounding_refuses_wrapping_counters():
    """NVFP4 SR draws from 2·⌈M/16⌉·K uint32 Philox counters: a tensor that would wrap them (and
    repeat random bits) is refused before any launch."""
    pytest.importorskip("triton")
    from hybrid_dist.kernels.nvfp4.quantize import nvfp4_quantize_tiles

    big = torch.zeros(1, dtype=torch.bfloat16).expand(2**20, 2**15 + 16)  # 2·2**16·(2**15 + 16) > 2**32
    t, amax, seed = torch.zeros(16), torch.ones(2), torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="Philox counters"):
        nvfp4_quantize_tiles(big, t, amax, seed, True, True, False, True, True, 1)
    with pytest.raises(ValueError, match="Philox counters"):  # rowwise only: the same counter space
        nvfp4_quantize_tiles(big, t, amax, seed, True, False, False, False, True, 1)


def _check_nvfp4_reference():
    import hybrid_dist as hd
    from hybrid_dist.kernels.nvfp4 import quantize as nvfp4
    from hybrid_dist.kernels.nvfp4.configs import NVFP4_SWEEP

    gen = torch.Generator().manual_seed(1)
    amax = torch.tensor(2688.0)
    for shape in ((96, 160), (128, 256)):  # partial tiles; whole tiles (the words kernel's EVEN)
        x = nvfp4_input(shape, gen)
        for block_2d in (False, True):
            q = hd.NVFP4Quantizer(block_2d=block_2d)
            for rw, cw in DIRS:
                k = nvfp4.quantize_nvfp4(q, x, rowwise=rw, columnwise=cw, state=None, amax=amax)
                r = q._quantize_2d(x, rowwise=rw, columnwise=cw, state=None, amax=amax)
                storages_equal(k[0], r[0], f"nvfp4 {shape} 2d={block_2d} dirs={rw, cw} row")
                storages_equal(k[1], r[1], f"nvfp4 {shape} 2d={block_2d} dirs={rw, cw} col")
    xr = nvfp4_rht_input((64, 96), 5, gen)
    for block_2d in (False, True):
        q = hd.NVFP4Quantizer(rht=True, rht_seed=5, block_2d=block_2d)
        r = q._quantize_2d(xr, rowwise=True, columnwise=True, state=None, amax=None)
        assert float(r[1].global_scale) == 1.0 and float(r[0].global_scale) == 0.25
        for cfg in NVFP4_SWEEP[:2]:
            k = nvfp4.quantize_nvfp4(q, xr, rowwise=True, columnwise=True, state=None, amax=None, config=cfg)
            storages_equal(k[0], r[0], f"nvfp4 rht 2d={block_2d} {cfg.label()} row")
            storages_equal(k[1], r[1], f"nvfp4 rht 2d={block_2d} {cfg.label()} col")

def _check_nvfp4_sr_stream():
    """Stochastic rounding: bitwise the reference fed the kernels' Philox stream
    (``tests/_nvfp4_sr_stream``), 1D and 2D blocks, with and without RHT, every direction set,
    two tile configs, partial and whole tiles, a seed with a non-zero high word."""
    from hybrid_dist.kernels.nvfp4 import quantize as nvfp4
    from hybrid_dist.kernels.nvfp4.configs import NVFP4_SWEEP
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
                storages_equal(k[0], r[0], f"{what} row")
                storages_equal(k[1], r[1], f"{what} col")

def _check_nvfp4_empty():
    """Empty inputs (a zero-token expert): the kernel still writes the global scales (1, as
    the reference's for amax 0) and returns empty data of the right shapes."""
    import hybrid_dist as hd
    from hybrid_dist.kernels.nvfp4 import quantize as nvfp4

    for shape in ((0, 128), (64, 0)):
        x = torch.zeros(shape).bfloat16()
        for q in (hd.NVFP4Quantizer(), hd.NVFP4Quantizer(rht=True), hd.NVFP4Quantizer(block_2d=True)):
            k = nvfp4.quantize_nvfp4(q, x, rowwise=True, columnwise=True, state=None, amax=None)
            r = q._quantize_2d(x, rowwise=True, columnwise=True, state=None, amax=None)
            for d, a, b in zip(("row", "col"), k, r):
                what = f"nvfp4 empty {shape} {q} {d}"
                assert a.data.shape == b.data.shape, what
                bits_equal(a.global_scale, b.global_scale.reshape(a.global_scale.shape), f"{what} global scale")


CHECKS = ('nvfp4_empty', 'nvfp4_reference', 'nvfp4_sr_stream')


@slow  # minutes of interpreted kernels on two cores: the slow tier
@pytest.mark.parametrize("check", CHECKS)
def test_nvfp4_under_triton_interpreter(check):
    run_check_under_triton_interpreter("tests.kernels.nvfp4.test_quantize", check)
