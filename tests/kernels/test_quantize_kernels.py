"""Every Triton quantize kernel against the reference backend, on the GPU.

Bitwise for FP8 per-tensor (current and delayed), FP8 block, MXFP8 and NVFP4 without
RHT/SR. NVFP4 with RHT multiplies by the Hadamard matrix in a different summation order
than the reference's fp32 matmul, so codes may flip where a value sits within an ulp of a
rounding boundary: bounded mismatch fraction, matching global scales to 1e-6.
Stochastic rounding uses a Philox stream (not torch.rand's): bitwise the reference fed that
stream (modelled in torch: ``tests/_nvfp4_sr_stream.py``; with RHT within the same bound),
and tested for reproducibility and unbiasedness.
Every tile config of ``kernels.quant_tiles`` is tested the same way as the default one.
"""

from __future__ import annotations

import pytest
import torch

import hybrid_dist as hd
from hybrid_dist.kernels.quant_tiles import (MXFP8_SWEEP, MXFP8_WORDS_SWEEP, NVFP4_2D_DEFAULT, NVFP4_DEFAULT,
                                             NVFP4_SWEEP, bf16_words)
from tests._kernel_helpers import assert_storages_bitwise, kernel_quantize, n_bit_diffs, reference_quantize

pytestmark = pytest.mark.gpu
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# non-power-of-two multiples of every block (128) and of the kernels' tiles
SHAPES = [(256, 512), (384, 640), (640, 1152)]
DIRS = [(True, True), (True, False), (False, True)]


def _x(shape, seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, device="cuda", generator=g) * torch.rand(shape[0], 1, device="cuda", generator=g) * 8
    x[0, :7] = 0.0  # exact zeros and a zero-amax block somewhere
    return x.to(dtype)


def _check(q, x, rowwise, columnwise, what, config=None, **kw):
    extra = {} if config is None else {"config": config}  # a non-default tile config
    k = kernel_quantize(q, x, rowwise=rowwise, columnwise=columnwise, **kw, **extra)
    r = reference_quantize(q, x, rowwise=rowwise, columnwise=columnwise, **kw)
    assert_storages_bitwise(k[0], r[0], f"{what} rowwise")
    assert_storages_bitwise(k[1], r[1], f"{what} columnwise")


@pytest.mark.parametrize("shape", SHAPES + [(100, 300)], ids=str)
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=str)
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_fp8_current_bitwise(shape, dtype, in_dtype):
    for pow2 in (False, True):
        q = hd.Float8Quantizer(dtype=dtype, power_of_2_scales=pow2)
        x = _x(shape, dtype=in_dtype)
        for rw, cw in DIRS:
            _check(q, x, rw, cw, f"fp8 {dtype} pow2={pow2} {shape} dirs={rw, cw}")
        amax = torch.tensor(3.0, device="cuda")  # precomputed (e.g. all-reduced) amax
        _check(q, x, True, True, f"fp8 {dtype} amax= {shape}", amax=amax)


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=str)
def test_fp8_batched_bitwise(dtype):
    """``quantize_fp8_batched`` (one amax and scale per matrix, two launches) equals the
    reference quantizer run on every matrix: data, transposed data and scale_inv."""
    from hybrid_dist.kernels.fp8_tensor import quantize_fp8_batched

    q = hd.Float8Quantizer(dtype=dtype)
    x = torch.stack([_x((384, 640), seed=s) * f for s, f in ((0, 1.0), (1, 300.0), (2, 1e-4))])
    x[1] = 0.0  # an all-zero matrix
    row, col, scale_inv = quantize_fp8_batched(q, x)
    for b in range(x.shape[0]):
        r_row, r_col = reference_quantize(q, x[b], rowwise=True, columnwise=True)
        what = f"{dtype} matrix {b}"
        assert torch.equal(row[b].view(torch.uint8), r_row.data.view(torch.uint8)), f"{what}: rowwise bytes"
        assert torch.equal(col[b].view(torch.uint8), r_col.data.view(torch.uint8)), f"{what}: columnwise bytes"
        assert torch.equal(scale_inv[b], r_row.scale_inv.float().reshape(())), f"{what}: scale_inv"


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fp8_delayed_bitwise_and_records_amax(shape):
    q = hd.Float8Quantizer(scaling="delayed")
    sk, sr = q.make_state(), q.make_state()
    sk.to("cuda"), sr.to("cuda")
    for step in range(3):
        x = _x(shape, seed=step)
        k = kernel_quantize(q, x, rowwise=True, columnwise=True, state=sk)
        r = reference_quantize(q, x, rowwise=True, columnwise=True, state=sr)
        assert_storages_bitwise(k[0], r[0], f"delayed step {step} rowwise")
        assert_storages_bitwise(k[1], r[1], f"delayed step {step} columnwise")
        assert torch.equal(sk.amax_history, sr.amax_history), f"step {step}: amax history differs"
        q.advance_state(sk), q.advance_state(sr)
        assert torch.equal(sk.scale, sr.scale)


@pytest.mark.parametrize("shape", SHAPES + [(96, 160)], ids=str)
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=str)
def test_mxfp8_bitwise(shape, dtype):
    q = hd.MXFP8Quantizer(dtype=dtype)
    x = _x(shape)
    x[3, 40] = 1e-30  # tiny amax: subnormal E8M0 ratio path
    for rw, cw in DIRS:
        _check(q, x, rw, cw, f"mxfp8 {dtype} {shape} dirs={rw, cw}")
    _check(q, _x(shape, dtype=torch.float32), True, True, f"mxfp8 fp32 input {shape}")


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("block", ["1x128", "128x128"])
def test_fp8_block_bitwise(shape, block):
    for pow2, eps in ((True, 0.0), (False, 0.0), (True, 1e-4)):
        q = hd.Float8BlockQuantizer(block=block, power_of_2_scales=pow2, amax_epsilon=eps)
        x = _x(shape)
        x[:128, :128] = 0.0  # an all-zero block (scale 1)
        for rw, cw in DIRS:
            _check(q, x, rw, cw, f"fp8_block {block} pow2={pow2} eps={eps} {shape} dirs={rw, cw}")


def test_fp8_block_1x128_rowwise_partial_tiles():
    """1x128 rowwise is the one FP8 block case where M need not be a multiple of 128: the
    kernel's last row of tiles is partial (masked), bitwise the reference."""
    for pow2 in (True, False):
        q = hd.Float8BlockQuantizer(block="1x128", power_of_2_scales=pow2)
        _check(q, _x((200, 384)), True, False, f"fp8_block 1x128 rowwise (200, 384) pow2={pow2}")


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=str)
def test_fp8_casts_saturate_like_the_reference(dtype):
    """The kernels cast without a clamp (``cvt.rn.satfinite``, ``_jit_common.cast_fp8``);
    the reference clamps, then casts. Same bytes for ±inf inputs, for scaled values past
    fp8_max (a precomputed amax below the data's), and for blocks whose amax is inf
    (scale 0: the inf elements become inf·0 = NaN, the others 0)."""
    x = _x((384, 640))
    x[5, 7], x[200, 300], x[130, 600] = float("inf"), float("-inf"), 3e38
    cases = [(hd.Float8Quantizer(dtype=dtype), {"amax": torch.tensor(3.0, device="cuda")}),
             (hd.Float8Quantizer(dtype=dtype, scaling="delayed"), {"state": _cuda_state(dtype)}),
             (hd.Float8BlockQuantizer(block="1x128", dtype=dtype), {}),
             (hd.Float8BlockQuantizer(block="128x128", dtype=dtype), {}),
             (hd.MXFP8Quantizer(dtype=dtype), {})]
    for q, kw in cases:
        what = f"{type(q).__name__} {getattr(q, 'block', getattr(q, 'scaling', ''))} {dtype} non-finite"
        if "state" in kw:  # each side advances its own copy of the delayed-scaling state
            k = kernel_quantize(q, x, rowwise=True, columnwise=True, state=kw["state"])
            r = reference_quantize(q, x, rowwise=True, columnwise=True, state=_cuda_state(dtype))
            assert_storages_bitwise(k[0], r[0], f"{what} rowwise")
            assert_storages_bitwise(k[1], r[1], f"{what} columnwise")
        else:
            _check(q, x, True, True, what, **kw)


def _cuda_state(dtype):
    """A delayed-scaling state whose scale (100) overflows most of ``_x``'s values."""
    st = hd.Float8Quantizer(dtype=dtype, scaling="delayed").make_state()
    st.to("cuda")
    st.scale.fill_(100.0)
    return st


@pytest.mark.parametrize("shape", SHAPES + [(96, 160)], ids=str)
@pytest.mark.parametrize("block_2d", [False, True], ids=["1d", "2d"])
def test_nvfp4_rne_bitwise(shape, block_2d):
    q = hd.NVFP4Quantizer(block_2d=block_2d)
    x = _x(shape)
    for rw, cw in DIRS:
        _check(q, x, rw, cw, f"nvfp4 2d={block_2d} {shape} dirs={rw, cw}")
    _check(q, x, True, True, f"nvfp4 amax= {shape}", amax=torch.tensor(40.0, device="cuda"))


def test_nvfp4_1d_tile_kernel_where_the_words_kernel_does_not_apply():
    """1×16 blocks from bf16 take ``nvfp4_words``; a 2-byte aligned bf16 view (all directions)
    and an fp32 input (rowwise) take the tile kernel, bitwise the reference too."""
    q = hd.NVFP4Quantizer()
    x = _x((96 * 160 + 1, 1)).reshape(-1)[1:].view(96, 160)
    assert not bf16_words(x) and bf16_words(x.clone())
    for rw, cw in DIRS:
        _check(q, x, rw, cw, f"nvfp4 1d unaligned bf16 dirs={rw, cw}")
    _check(q, _x((96, 160), dtype=torch.float32), True, False, "nvfp4 1d fp32 rowwise")
    _check(q, _x((96, 160), dtype=torch.float32), True, True, "nvfp4 1d fp32 row+col")


def _check_rht_within_bound(q, x, what, **kw):
    k = kernel_quantize(q, x, rowwise=True, columnwise=True, **kw)
    r = reference_quantize(q, x, rowwise=True, columnwise=True)
    assert_storages_bitwise(k[0], r[0], f"{what} rht rowwise (not transformed)")
    _rht_within_bound(k[1], r[1], x, q, what)


def _rht_within_bound(kc, rc, x, q, what):
    """The columnwise RHT direction: global scale to 1e-6, few codes and scales differ, and
    as close to ``x`` as the reference's."""
    assert kc.rht_seed == rc.rht_seed == q.rht_seed
    assert torch.allclose(kc.global_scale, rc.global_scale, rtol=1e-6, atol=0), what
    codes = n_bit_diffs(kc.data, rc.data, "rht data")
    scales = n_bit_diffs(kc.block_scale, rc.block_scale, "rht block_scale")
    assert codes <= 1e-3 * rc.data.numel(), f"{what}: {codes} of {rc.data.numel()} packed bytes differ"
    assert scales <= 1e-2 * rc.block_scale.numel(), f"{what}: {scales} block scales differ"
    # in the transformed domain the kernel's values are as close to x as the reference's
    v_k, v_r = kc.dequantize(), rc.dequantize()
    err_k = (v_k - x.float()).norm() / x.float().norm()
    err_r = (v_r - x.float()).norm() / x.float().norm()
    assert err_k <= err_r * 1.01 + 1e-6, (what, err_k, err_r)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("block_2d", [False, True], ids=["1d", "2d"])
def test_nvfp4_rht_within_bound(shape, block_2d):
    _check_rht_within_bound(hd.NVFP4Quantizer(rht=True, block_2d=block_2d), _x(shape), f"{shape} 2d={block_2d}")


@pytest.mark.parametrize("sr", [False, True], ids=["rne", "sr"])
@pytest.mark.parametrize("cfg", NVFP4_SWEEP, ids=lambda c: c.label())
def test_nvfp4_rht_words_kernel_bitwise_tile_kernel(cfg, sr):
    """1×16 blocks with RHT from bf16 take the words kernel: bitwise the tile kernel (the same
    fp32 transform, block scales and codes), every direction set, at every tile config and
    the tile kernel's default, with partial tiles along M and K (96x160), +-inf, bf16
    subnormals and tiny normals (the tile kernel's products ``x/4`` subnormal: the words
    kernel's unscaled butterflies, ``kernels._rht_words``, are exact there too). ``sr``:
    stochastic rounding (the tile kernel's Philox stream, a key with a non-zero high word) of
    one direction: columnwise with RHT, rowwise with and without (``nvfp4_words``' note "SR")."""
    from hybrid_dist.kernels.nvfp4 import _rht_row, nvfp4_amax_tiles, nvfp4_quantize_tiles

    seed = torch.tensor([(5 << 32) + 77 if sr else 0], dtype=torch.int64, device="cuda")
    cases = [(True, False, False), (True, False, True), (False, True, True)] if sr else [
        (rw, cw, True) for rw, cw in DIRS]
    for shape in ((384, 640), (96, 160)):
        for x in (_x(shape), _x(shape, seed=1)):
            if shape == (96, 160):
                x[37, 5], x[70, 90] = float("inf"), float("-inf")
                x[:16, :8] *= 2.0**-120
                x[16:32, 8:16] = 2.0**-133 * torch.randint(-3, 4, (16, 8), device="cuda")
            t = _rht_row(3, x.device)
            for rw, cw, rht in cases:
                amax = nvfp4_amax_tiles(x, t, rht)
                what = f"nvfp4 words {cfg.label()} {shape} rht={rht} sr={sr} dirs={rw, cw}"
                w = nvfp4_quantize_tiles(x, t, amax, seed, rw, cw, False, rht, sr, 1, config=cfg, words=True)
                ti = nvfp4_quantize_tiles(x, t, amax, seed, rw, cw, False, rht, sr, 1, words=False)
                for name, a, b in zip(("row", "row scales", "col", "col scales", "row gs", "col gs"), w, ti):
                    a, b = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
                    if name == "row" and rw:  # an inf's code (its scaled value NaN): the sign may differ
                        a, b = a & _row_sign_mask(x), b & _row_sign_mask(x)
                    if name == "col" and cw:  # so in an inf's columnwise block (every value inf or NaN)
                        a, b = a & _col_sign_mask(x), b & _col_sign_mask(x)
                    assert torch.equal(a, b), f"{what}: {name} differ"


def _row_sign_mask(x):
    """Per rowwise NVFP4 data byte of ``x``: ``0xFF`` less the sign bit of each non-finite
    element's code (the words kernel takes a code's sign from the input's bits, the tile
    kernel from the scaled value, a NaN there; ``nvfp4_words``' note "signs")."""
    bad = (~torch.isfinite(x)).to(torch.uint8)
    return (0xFF ^ ((bad[:, 0::2] << 3) | (bad[:, 1::2] << 7))).reshape(-1)


def _col_sign_mask(x):
    """Per columnwise NVFP4 data byte (``[K, M/2]``): ``0xFF`` less the two sign bits in each
    16×1 block holding a non-finite element (the words kernel's RHT takes a code's sign from
    the transformed value, the tile kernel from the scaled one, NaN there: ``kernels.
    _rht_words``)."""
    m, k = x.shape
    bad = (~torch.isfinite(x)).reshape(m // 16, 16, k).any(dim=1).t()  # [K, M/16]
    return (0xFF ^ (bad.to(torch.uint8) * 0x88)).repeat_interleave(8, dim=1).reshape(-1)


def test_nvfp4_negative_zero_encodes_as_code_8():
    """``-0.0`` (in a zero block and among non-zeros) encodes as the negative zero ``0x8`` on
    every NVFP4 kernel, as the reference: the words kernel (bf16) takes the sign from the
    input's bits, the tile kernel (fp32; and 16×16 blocks) from the scaled value's."""
    for dtype in (torch.bfloat16, torch.float32):
        x = _x((384, 640), dtype=dtype)
        x[0, :3], x[100, 17], x[101, 0] = -0.0, -0.0, -0.0
        for block_2d in (False, True):
            q = hd.NVFP4Quantizer(block_2d=block_2d)
            for rw, cw in DIRS:
                _check(q, x, rw, cw, f"nvfp4 -0.0 {dtype} 2d={block_2d} dirs={rw, cw}")
        row, col = kernel_quantize(hd.NVFP4Quantizer(), x, rowwise=True, columnwise=True)
        assert int(row.data[100, 8]) >> 4 == 0x8 and int(row.data[0, 0]) == 0x88, f"{dtype}: rowwise codes"
        assert int(col.data[17, 50]) & 0xF == 0x8 and int(col.data[0, 0]) & 0xF == 0x8, f"{dtype}: columnwise"


def test_nvfp4_stochastic_rounding_reproducible_and_unbiased():
    q = hd.NVFP4Quantizer(stochastic_rounding=True, seed=7)
    x = _x((256, 512))
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


def _unaligned(x):
    """``x``'s values in a 2-byte aligned view: not readable as int32 words."""
    m, k = x.shape
    v = torch.empty(m * k + 1, dtype=x.dtype, device=x.device)[1:].view(m, k)
    v.copy_(x)
    assert not bf16_words(v)
    return v


MXFP8_KERNEL_CONFIGS = [("words", c) for c in MXFP8_WORDS_SWEEP] + [("row sets", c) for c in MXFP8_SWEEP]


@pytest.mark.parametrize("kernel,cfg", MXFP8_KERNEL_CONFIGS, ids=lambda v: v if isinstance(v, str) else v.label())
def test_mxfp8_tile_configs_bitwise(kernel, cfg):
    """Both columnwise kernels at every tile config: word-aligned bf16 takes ``mxfp8_words``,
    a 2-byte aligned view the 32-row-set kernel (rowwise alone is ``mxfp8_v1``'s, or the row-set
    kernel's at a 32-row config). Shapes with partial tiles along M and K."""
    dirs = DIRS if kernel == "row sets" else [(True, True), (False, True)]
    for dtype in (E4M3, E5M2):
        q = hd.MXFP8Quantizer(dtype=dtype)
        for shape in ((384, 640), (96, 160), (160, 96)):
            x = _x(shape)
            x[3, 40 % shape[1]] = 1e-30
            x[37, 5], x[70, 90 % shape[1]] = float("inf"), float("-inf")
            if kernel == "row sets":
                x = _unaligned(x)
            for rw, cw in dirs:
                _check(q, x, rw, cw, f"mxfp8 {kernel} {cfg.label()} {dtype} {shape} dirs={rw, cw}", config=cfg)


@pytest.mark.parametrize("cfg", NVFP4_SWEEP, ids=lambda c: c.label())
def test_nvfp4_tile_configs(cfg):
    """RNE bitwise the reference; RHT within the bound; SR bitwise the reference fed the
    kernels' stream (with RHT: within the bound). Every
    direction set for the default configs, row+col for the others (compile time)."""
    dirs = DIRS if cfg in (NVFP4_DEFAULT, NVFP4_2D_DEFAULT) else [(True, True)]
    for shape in ((384, 640), (96, 160)):
        x = _x(shape)
        for block_2d in (False, True):
            q = hd.NVFP4Quantizer(block_2d=block_2d)
            for rw, cw in dirs:
                _check(q, x, rw, cw, f"nvfp4 {cfg.label()} 2d={block_2d} {shape} dirs={rw, cw}", config=cfg)
            _check(q, x, True, True, f"nvfp4 {cfg.label()} amax= {shape}", config=cfg,
                   amax=torch.tensor(40.0, device="cuda"))
    x = _x((384, 640))
    for block_2d in (False, True):
        _check_rht_within_bound(hd.NVFP4Quantizer(rht=True, block_2d=block_2d), x,
                                f"{cfg.label()} 2d={block_2d}", config=cfg)
        _check_sr_stream(x, block_2d, cfg)


def _check_sr_stream(x, block_2d, cfg, dirs=((True, True),)):
    from hybrid_dist.kernels.nvfp4 import quantize_nvfp4
    from tests._nvfp4_sr_stream import KernelStreamNVFP4, fixed_kernel_seed

    seed = (3 << 32) + 12345
    for rht in (False, True):
        q = KernelStreamNVFP4(stochastic_rounding=True, rht=rht, block_2d=block_2d, kernel_seed=seed)
        for rw, cw in dirs:
            what = f"nvfp4 sr rht={rht} 2d={block_2d} {cfg.label()} {tuple(x.shape)} dirs={rw, cw}"
            with fixed_kernel_seed(seed):
                k = quantize_nvfp4(q, x, rowwise=rw, columnwise=cw, state=None, amax=None, config=cfg)
            r = reference_quantize(q, x, rowwise=rw, columnwise=cw)
            assert_storages_bitwise(k[0], r[0], f"{what} rowwise")
            if rht and cw:
                _rht_within_bound(k[1], r[1], x, q, what)
            else:
                assert_storages_bitwise(k[1], r[1], f"{what} columnwise")


@pytest.mark.parametrize("shape", [(384, 640), (96, 160), (4096, 2048)], ids=str)
def test_nvfp4_sr_stream_every_direction_set(shape):
    """Stochastic rounding at the default tile configs, every direction set (partial tiles
    along M and K at 96x160)."""
    x = _x(shape)
    for block_2d, cfg in ((False, NVFP4_DEFAULT), (True, NVFP4_2D_DEFAULT)):
        _check_sr_stream(x, block_2d, cfg, dirs=DIRS)


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float16], ids=str)
def test_non_bf16_inputs_take_the_kernels_in_every_direction(in_dtype):
    """fp32 / fp16 inputs run on the kernels in every direction set (``kernel_quantize``
    fails on a reference fallback), bitwise the reference: FP8 per-tensor (fp32: rowwise and a
    torch transpose, ``fp8_tensor``'s note on fp32 inputs) and blocks, MXFP8 through the
    32-row-set kernel, NVFP4 through the tile kernel (RHT within its bound, SR bitwise the
    reference fed the kernels' stream)."""
    for shape in ((384, 640), (640, 1152), (96, 160)):
        x = _x(shape, dtype=in_dtype)
        qs = [hd.Float8Quantizer(), hd.Float8Quantizer(dtype=E5M2, power_of_2_scales=True), hd.NVFP4Quantizer(),
              hd.NVFP4Quantizer(block_2d=True), hd.MXFP8Quantizer(), hd.MXFP8Quantizer(dtype=E5M2)]
        if shape[0] % 128 == 0 and shape[1] % 128 == 0:
            qs += [hd.Float8BlockQuantizer(block="1x128"), hd.Float8BlockQuantizer(block="128x128")]
        for q in qs:
            for rw, cw in DIRS:
                _check(q, x, rw, cw, f"{q} {in_dtype} {shape} dirs={rw, cw}")
        q = hd.Float8Quantizer(scaling="delayed")
        sk, sr = _cuda_state(E4M3), _cuda_state(E4M3)
        k = kernel_quantize(q, x, rowwise=True, columnwise=True, state=sk)
        r = reference_quantize(q, x, rowwise=True, columnwise=True, state=sr)
        assert_storages_bitwise(k[1], r[1], f"delayed {in_dtype} {shape} columnwise")
        assert torch.equal(sk.amax_history, sr.amax_history), f"delayed {in_dtype} {shape}: amax history"
        _check_rht_within_bound(hd.NVFP4Quantizer(rht=True), x, f"{in_dtype} {shape}")
        for block_2d, cfg in ((False, NVFP4_DEFAULT), (True, NVFP4_2D_DEFAULT)):
            _check_sr_stream(x, block_2d, cfg, dirs=DIRS)


@pytest.mark.parametrize("shape", [(384, 640), (4096, 2048)], ids=str)
def test_nvfp4_amax_pass(shape):
    from hybrid_dist.formats.numerics import apply_hadamard16, hadamard16
    from hybrid_dist.kernels.nvfp4 import _rht_row, nvfp4_amax_tiles

    x = _x(shape)
    for seed in (0, 3):
        out = nvfp4_amax_tiles(x, _rht_row(seed, x.device), True)
        assert out[0] == x.float().abs().amax(), (shape, seed)
        ref_h = apply_hadamard16(x.t().float(), hadamard16(seed, x.device)).abs().amax()
        assert torch.allclose(out[1], ref_h, rtol=1e-6, atol=0), (shape, seed, out[1], ref_h)
    assert nvfp4_amax_tiles(x, _rht_row(0, x.device), False)[1] == 0
    x[7, 9] = -3e4  # without RHT: the amax itself, from word-aligned bf16 and from a 2-byte aligned view
    for xi in (x, _unaligned(x)):
        out = nvfp4_amax_tiles(xi, _rht_row(0, x.device), False)
        assert out[0] == x.float().abs().amax() and out[1] == 0, (shape, out)
