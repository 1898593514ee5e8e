"""Non-finite input is never hidden: a NaN element dequantizes to NaN in every format and
direction (at least the element itself; block formats may poison its whole block)."""

from __future__ import annotations

import pytest
import torch

from hybrid_dist.formats import Float8BlockQuantizer, Float8Quantizer, MXFP8Quantizer, NVFP4Quantizer

QUANTIZERS = {
    "fp8": Float8Quantizer(),
    "fp8_block_1x128": Float8BlockQuantizer(),
    "fp8_block_128x128": Float8BlockQuantizer(block="128x128"),
    "mxfp8": MXFP8Quantizer(),
    "nvfp4": NVFP4Quantizer(),
    "nvfp4_rht_2d": NVFP4Quantizer(rht=True, block_2d=True),
}


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_nan_propagates(name):
    x = torch.randn(128, 128, generator=torch.Generator().manual_seed(0))
    x[3, 5] = float("nan")
    t = QUANTIZERS[name].quantize(x)
    for d in ("rowwise", "columnwise"):
        dq = t.dequantize(d)
        assert bool(torch.isnan(dq[3, 5])), f"{name} {d}: NaN lost"
        # NaN stays local: at most the scale block holding it (16x16 for NVFP4 2D; 32 for MXFP8)
        assert int(torch.isnan(dq).sum()) <= 256, f"{name} {d}"
        assert int(torch.isnan(dq[16:, 16:]).sum()) == 0, f"{name} {d}"
