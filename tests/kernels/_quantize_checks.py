"""Inputs and checks shared by the quantize-kernel tests of ``tests/kernels/*/``.

On the GPU (``make_x``, ``check_bitwise``): random data, every kernel bitwise the reference
(``tests/_kernel_helpers``), NVFP4 with RHT within a bound (``rht_within_bound``: the kernel
sums the Hadamard products in another fp32 order than the reference's matmul), stochastic
rounding bitwise the reference fed the kernels' Philox stream (``check_sr_stream``; modelled
in torch: ``tests/_nvfp4_sr_stream.py``).

Under the Triton interpreter (``bits_equal``, ``storages_equal``, ``*_input``): its fp32 → fp8
cast does not round like the GPU's ``cvt.rn.satfinite`` (ties, and carries into the exponent),
so the inputs are built so that every fp8 cast is exact (values with few mantissa bits, global
scales that are powers of two); then the kernels must be bitwise equal to the reference.
"""

from __future__ import annotations

import torch

import hybrid_dist as hd
from hybrid_dist.kernels.tile_config import bf16_words
from tests._kernel_helpers import assert_storages_bitwise, kernel_quantize, n_bit_diffs, reference_quantize


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# non-power-of-two multiples of every block (128) and of the kernels' tiles
SHAPES = [(256, 512), (384, 640), (640, 1152)]
DIRS = [(True, True), (True, False), (False, True)]


def make_x(shape, seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, device="cuda", generator=g) * torch.rand(shape[0], 1, device="cuda", generator=g) * 8
    x[0, :7] = 0.0  # exact zeros and a zero-amax block somewhere
    return x.to(dtype)

def check_bitwise(q, x, rowwise, columnwise, what, config=None, **kw):
    extra = {} if config is None else {"config": config}  # a non-default tile config
    k = kernel_quantize(q, x, rowwise=rowwise, columnwise=columnwise, **kw, **extra)
    r = reference_quantize(q, x, rowwise=rowwise, columnwise=columnwise, **kw)
    assert_storages_bitwise(k[0], r[0], f"{what} rowwise")
    assert_storages_bitwise(k[1], r[1], f"{what} columnwise")

def cuda_delayed_state(dtype):
    """A delayed-scaling state whose scale (100) overflows most of ``make_x``'s values."""
    st = hd.Float8Quantizer(dtype=dtype, scaling="delayed").make_state()
    st.to("cuda")
    st.scale.fill_(100.0)
    return st

def unaligned(x):
    """``x``'s values in a 2-byte aligned view: not readable as int32 words."""
    m, k = x.shape
    v = torch.empty(m * k + 1, dtype=x.dtype, device=x.device)[1:].view(m, k)
    v.copy_(x)
    assert not bf16_words(v)
    return v

def check_rht_within_bound(q, x, what, **kw):
    k = kernel_quantize(q, x, rowwise=True, columnwise=True, **kw)
    r = reference_quantize(q, x, rowwise=True, columnwise=True)
    assert_storages_bitwise(k[0], r[0], f"{what} rht rowwise (not transformed)")
    rht_within_bound(k[1], r[1], x, q, what)

def rht_within_bound(kc, rc, x, q, what):
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

def check_sr_stream(x, block_2d, cfg, dirs=((True, True),)):
    from hybrid_dist.kernels.nvfp4.quantize import quantize_nvfp4
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
                rht_within_bound(k[1], r[1], x, q, what)
            else:
                assert_storages_bitwise(k[1], r[1], f"{what} columnwise")


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

def bits_equal(a, b, what):
    assert (a is None) == (b is None), what
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    n = int((a.reshape(-1).contiguous().view(torch.uint8) != b.reshape(-1).contiguous().view(torch.uint8)).sum())
    assert n == 0, f"{what}: {n} bytes differ"

def storages_equal(k, r, what):
    assert (k is None) == (r is None), f"{what}: one direction missing"
    if r is None:
        return
    assert k.same_meta(r), f"{what}: metadata differs"
    for f in r.TENSOR_FIELDS:
        bits_equal(getattr(k, f), getattr(r, f), f"{what}.{f}")
