"""fp32 / fp16 inputs on the GPU take the kernels of every format in every direction set, bitwise the reference.
"""

from __future__ import annotations

import pytest
import torch

import hybrid_dist as hd
from tests._kernel_helpers import assert_storages_bitwise, kernel_quantize, reference_quantize
from tests.kernels._quantize_checks import (DIRS, E4M3, E5M2, check_bitwise, check_rht_within_bound, check_sr_stream,
                                          cuda_delayed_state, make_x)
from hybrid_dist.kernels.nvfp4.configs import NVFP4_2D_DEFAULT, NVFP4_DEFAULT

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float16], ids=str)
def test_non_bf16_inputs_take_the_kernels_in_every_direction(in_dtype):
    """fp32 / fp16 inputs run on the kernels in every direction set (``kernel_quantize``
    fails on a reference fallback), bitwise the reference: FP8 per-tensor (fp32: rowwise and a
    torch transpose, ``fp8.tensor``'s note on fp32 inputs) and blocks, MXFP8 through the
    32-row-set kernel, NVFP4 through the tile kernel (RHT within its bound, SR bitwise the
    reference fed the kernels' stream)."""
    for shape in ((384, 640), (640, 1152), (96, 160)):
        x = make_x(shape, dtype=in_dtype)
        qs = [hd.Float8Quantizer(), hd.Float8Quantizer(dtype=E5M2, power_of_2_scales=True), hd.NVFP4Quantizer(),
              hd.NVFP4Quantizer(block_2d=True), hd.MXFP8Quantizer(), hd.MXFP8Quantizer(dtype=E5M2)]
        if shape[0] % 128 == 0 and shape[1] % 128 == 0:
            qs += [hd.Float8BlockQuantizer(block="1x128"), hd.Float8BlockQuantizer(block="128x128")]
        for q in qs:
            for rw, cw in DIRS:
                check_bitwise(q, x, rw, cw, f"{q} {in_dtype} {shape} dirs={rw, cw}")
        q = hd.Float8Quantizer(scaling="delayed")
        sk, sr = cuda_delayed_state(E4M3), cuda_delayed_state(E4M3)
        k = kernel_quantize(q, x, rowwise=True, columnwise=True, state=sk)
        r = reference_quantize(q, x, rowwise=True, columnwise=True, state=sr)
        assert_storages_bitwise(k[1], r[1], f"delayed {in_dtype} {shape} columnwise")
        assert torch.equal(sk.amax_history, sr.amax_history), f"delayed {in_dtype} {shape}: amax history"
        check_rht_within_bound(hd.NVFP4Quantizer(rht=True), x, f"{in_dtype} {shape}")
        for block_2d, cfg in ((False, NVFP4_DEFAULT), (True, NVFP4_2D_DEFAULT)):
            check_sr_stream(x, block_2d, cfg, dirs=DIRS)
