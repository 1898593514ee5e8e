"""Identity (``formats/identity.py``): a high-precision passthrough direction."""

from __future__ import annotations

import torch

from hybrid_dist.formats import IdentityQuantizer, IdentityStorage, MXFP8Quantizer, NVFP4Quantizer
from tests._helpers import assert_bitwise_equal


def _x(dtype=torch.float32):
    return torch.randn(2, 8, 12, generator=torch.Generator().manual_seed(0)).to(dtype)


def test_keeps_the_input_bitwise_and_columnwise_is_a_transposed_view():
    x = _x(torch.bfloat16)
    t = IdentityQuantizer().quantize(x)
    row, col = t.rowwise, t.columnwise
    assert isinstance(row, IdentityStorage) and row.data.dtype == torch.bfloat16
    assert_bitwise_equal(row.data, x.reshape(16, 12), "rowwise data")
    assert col.data.shape == (12, 16) and col.transposed
    assert col.data.data_ptr() == row.data.data_ptr() and col.data.stride() == (1, 12), "a view, no copy"
    assert_bitwise_equal(t.dequantize("columnwise"), x, "columnwise dequantize")
    assert row.nbytes() == 16 * 12 * 2


def test_dtype_casts_the_stored_copy_and_dequantize_returns_the_tensor_dtype():
    x = _x()
    t = IdentityQuantizer(dtype=torch.bfloat16).quantize(x)
    assert t.rowwise.data.dtype == torch.bfloat16 and t.dtype == torch.float32
    assert_bitwise_equal(t.dequantize(), x.to(torch.bfloat16).float(), "bf16 round trip")
    up = IdentityQuantizer(dtype=torch.float32).quantize(x.to(torch.bfloat16))
    assert up.rowwise.data.dtype == torch.float32 and up.dequantize().dtype == torch.bfloat16


def test_identity_is_the_most_precise_format():
    assert IdentityQuantizer.PRECISION_RANK > MXFP8Quantizer.PRECISION_RANK > NVFP4Quantizer.PRECISION_RANK
    assert not IdentityQuantizer().is_per_tensor and IdentityQuantizer().make_state() is None
    assert IdentityQuantizer().block_shape("rowwise") == IdentityQuantizer().block_shape("columnwise") == (1, 1)
