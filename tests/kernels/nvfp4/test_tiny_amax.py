"""NVFP4 kernels on a tiny tensor (amax below ``2688 / fp32 max``: global scale ``2**-128``)
under the Triton interpreter, on CPU: bitwise the reference.

There the combined scale ``bs · gs`` is subnormal for every block scale below 4, its
reciprocal is above ``2**126`` (outside ``rcp_fast``'s range) and, for a block scale below 1,
above the fp32 max, where it is clamped (``formats.nvfp4``); ``RN(1/gs)`` itself is inf, so
the kernels take IEEE divisions for such a global scale (``_jit_common.nvfp4_block_scale``).
The inputs make every fp8 cast exact (the interpreter's fp8 cast rounds unlike the GPU's):
block scales ``1.mmm · 2**e`` (E4M3, from ``2**-8`` to 240), elements ``6 · 1.mmm · 2**(e - 128)``.
The tile kernel runs on fp32 (subnormal elements too), the words kernel on bf16 (normal
elements only: the interpreter's bf16 → fp32 cast flushes subnormals, the GPU's does not).
The same check on random data on the GPU: ``tests/kernels/test_jit_common.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests._helpers import run_under_triton_interpreter

DIRS = [(True, True), (True, False), (False, True)]


def tiny_input(shape, gen, *, normal_only: bool) -> torch.Tensor:
    """fp32 ``±6 · 1.mmm · 2**(e - 128)``, block exponents ``e`` from -8 to 7 by row (one
    block scale per binade, from a subnormal E4M3 up to 240), elements up to 3 binades below
    their block's; ``normal_only`` keeps every element at or above ``2**-126`` (block scales
    from 0.6875 up, several below 1: the clamped reciprocal)."""
    m, k = shape
    e_row = torch.arange(m).remainder(16) - 8  # [-8, 7]
    e = e_row[:, None] + torch.randint(-3, 1, shape, generator=gen)
    bits = (3 - (-6 - e_row).clamp(min=0))[:, None]  # E4M3 subnormals (e < -6) hold fewer mantissa bits
    mant = 1.0 + torch.floor(torch.randint(0, 8, shape, generator=gen) / 2.0 ** (3 - bits)) / 2.0**bits
    if normal_only:
        e = e.clamp(min=-1)
        mant = torch.where(e == -1, mant.clamp(min=1.375), mant)  # 6 · 1.375 · 2**-129 > 2**-126
    sign = torch.randint(0, 2, shape, generator=gen).float() * 2 - 1
    x = sign * 6.0 * mant * torch.exp2(e.float() - 128)
    x[:16, :16] = 0.0  # an all-zero block in both directions
    return x


def _check():
    import hybrid_dist as hd
    from hybrid_dist.kernels.nvfp4 import quantize as nvfp4
    from hybrid_dist.kernels.nvfp4.configs import NVFP4_SWEEP
    from tests.kernels._quantize_checks import storages_equal

    gen = torch.Generator().manual_seed(0)
    x32 = tiny_input((32, 96), gen, normal_only=False)
    xbf = tiny_input((32, 128), gen, normal_only=True).bfloat16()
    for x, what in ((x32, "fp32 tile kernel"), (xbf, "bf16 words kernel")):
        for block_2d in (False, True):
            q = hd.NVFP4Quantizer(block_2d=block_2d)
            for rw, cw in DIRS:
                k = nvfp4.quantize_nvfp4(q, x, rowwise=rw, columnwise=cw, state=None, amax=None,
                                         config=NVFP4_SWEEP[0] if x is x32 else None)
                r = q._quantize_2d(x, rowwise=rw, columnwise=cw, state=None, amax=None)
                st = r[0] if rw else r[1]
                assert float(st.global_scale) == 2.0**-128, (what, float(st.global_scale))
                storages_equal(k[0], r[0], f"nvfp4 tiny {what} 2d={block_2d} dirs={rw, cw} row")
                storages_equal(k[1], r[1], f"nvfp4 tiny {what} 2d={block_2d} dirs={rw, cw} col")
    print("TINY_OK")


def test_nvfp4_kernels_bitwise_the_reference_on_a_tiny_tensor():
    run_under_triton_interpreter("from tests.kernels.nvfp4.test_tiny_amax import _check; _check()",
                                 done="TINY_OK")


@pytest.mark.gpu
@pytest.mark.parametrize("amax", [1e-37, 1e-38, 1e-40], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_nvfp4_kernels_bitwise_the_reference_on_tiny_random_tensors_gpu(amax, dtype):
    """Random tiny tensors on the GPU (no exact-cast constraint there): the words kernel
    (1×16 from bf16), the tile kernel (fp32, 2D), every direction set, bitwise; RHT within
    the tile kernel's bound elsewhere, so left out."""
    from tests._kernel_helpers import assert_storages_bitwise, kernel_quantize, reference_quantize

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import hybrid_dist as hd

    g = torch.randn(256, 512, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = (g / g.abs().max() * amax).to(dtype).cuda()
    x[:16, :16] = 0.0
    for block_2d in (False, True):
        q = hd.NVFP4Quantizer(block_2d=block_2d)
        for rw, cw in DIRS:
            k, r = kernel_quantize(q, x, rowwise=rw, columnwise=cw), reference_quantize(q, x, rowwise=rw, columnwise=cw)
            what = f"nvfp4 tiny amax={amax} {dtype} 2d={block_2d} dirs={rw, cw}"
            assert_storages_bitwise(k[0], r[0], f"{what} rowwise")
            assert_storages_bitwise(k[1], r[1], f"{what} columnwise")
