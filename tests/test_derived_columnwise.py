"""``hybrid_dist.derived_columnwise``: which quantizers' columnwise direction is their
rowwise one transposed, and that the derived storage is bitwise the one quantizing gives
(so the TP gathers and the MoE exchange can send rowwise bytes only)."""

from __future__ import annotations

import pytest
import torch

import hybrid_dist as hd
from hybrid_dist.derived_columnwise import derivable_columnwise, derive_columnwise
from tests._helpers import assert_storage_equal

DERIVABLE = {
    "fp8 e4m3 current": hd.Float8Quantizer(),
    "fp8 e5m2 current": hd.Float8Quantizer(dtype=torch.float8_e5m2),
    "fp8 delayed": hd.Float8Quantizer(scaling="delayed"),
    "identity": hd.IdentityQuantizer(),
    "hybrid of one fp8 quantizer": hd.HybridQuantizer(rowwise=hd.Float8Quantizer(), columnwise=hd.Float8Quantizer()),
}
NOT_DERIVABLE = {
    "mxfp8": hd.MXFP8Quantizer(),
    "fp8 1x128": hd.Float8BlockQuantizer(block="1x128"),
    "nvfp4": hd.NVFP4Quantizer(),
    "fp8 e4m3 / e5m2": hd.HybridQuantizer(rowwise=hd.Float8Quantizer(),
                                          columnwise=hd.Float8Quantizer(dtype=torch.float8_e5m2)),
    "fp8 / identity": hd.HybridQuantizer(rowwise=hd.Float8Quantizer(), columnwise=hd.IdentityQuantizer()),
}


@pytest.mark.parametrize("name", sorted(DERIVABLE))
def test_derived_columnwise_is_bitwise_the_quantized_one(name):
    q = DERIVABLE[name]
    assert derivable_columnwise(q), name
    torch.manual_seed(0)
    x = torch.randn(96, 160, dtype=torch.bfloat16) * torch.logspace(-3, 3, 160, dtype=torch.bfloat16)
    state = q.make_state()
    row, col = q.quantize_storages(x, rowwise=True, columnwise=True, state=state)
    derived = derive_columnwise(row)
    assert_storage_equal(derived, col, name)
    assert derived.logical_shape2d == (96, 160)


@pytest.mark.parametrize("name", sorted(NOT_DERIVABLE))
def test_other_quantizers_are_not_derivable(name):
    assert not derivable_columnwise(NOT_DERIVABLE[name]), name
