"""Stored layouts of every format, per direction, exactly as the format files' docstrings
state them, for a logical ``[M, K] = [128, 256]`` tensor given as ``[2, 64, 256]``
(M = 128 is the product of the leading dims).

Also: asking for one direction makes only that one (bitwise the same as from a
both-direction call); the columnwise direction is the exact transpose of the rowwise one
where the docstring says so (per-tensor FP8, 128×128, NVFP4 2D) and a different
quantization where it says so (1×128, MXFP8, NVFP4 1D).
"""

from __future__ import annotations

import pytest
import torch

from hybrid_dist.formats import (
    Float8BlockQuantizer,
    Float8Quantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)
from hybrid_dist.formats.numerics import unpack_fp4
from tests._helpers import assert_bitwise_equal, assert_storage_equal

M, K = 128, 256
F32, U8, E4M3, E5M2, BF16 = torch.float32, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16

# id -> (quantizer, {direction: {field: (shape, dtype)}})
LAYOUTS = {
    "fp8": (Float8Quantizer(), {
        "rowwise": {"data": ((M, K), E4M3), "scale_inv": ((), F32)},
        "columnwise": {"data": ((K, M), E4M3), "scale_inv": ((), F32)},
    }),
    "fp8_e5m2": (Float8Quantizer(dtype=E5M2), {
        "rowwise": {"data": ((M, K), E5M2), "scale_inv": ((), F32)},
        "columnwise": {"data": ((K, M), E5M2), "scale_inv": ((), F32)},
    }),
    "fp8_block_1x128": (Float8BlockQuantizer(), {
        "rowwise": {"data": ((M, K), E4M3), "scale_inv": ((M, K // 128), F32)},
        "columnwise": {"data": ((K, M), E4M3), "scale_inv": ((K, M // 128), F32)},
    }),
    "fp8_block_128x128": (Float8BlockQuantizer(block="128x128"), {
        "rowwise": {"data": ((M, K), E4M3), "scale_inv": ((M // 128, K // 128), F32)},
        "columnwise": {"data": ((K, M), E4M3), "scale_inv": ((K // 128, M // 128), F32)},
    }),
    "mxfp8": (MXFP8Quantizer(), {
        "rowwise": {"data": ((M, K), E4M3), "scale": ((M, K // 32), U8)},
        "columnwise": {"data": ((K, M), E4M3), "scale": ((K, M // 32), U8)},
    }),
    "nvfp4": (NVFP4Quantizer(), {
        "rowwise": {"data": ((M, K // 2), U8), "block_scale": ((M, K // 16), E4M3), "global_scale": ((), F32)},
        "columnwise": {"data": ((K, M // 2), U8), "block_scale": ((K, M // 16), E4M3), "global_scale": ((), F32)},
    }),
    "nvfp4_2d": (NVFP4Quantizer(block_2d=True), {
        "rowwise": {"data": ((M, K // 2), U8), "block_scale": ((M // 16, K // 16), E4M3), "global_scale": ((), F32)},
        "columnwise": {"data": ((K, M // 2), U8), "block_scale": ((K // 16, M // 16), E4M3), "global_scale": ((), F32)},
    }),
    "nvfp4_rht_sr": (NVFP4Quantizer(rht=True, stochastic_rounding=True), {
        "rowwise": {"data": ((M, K // 2), U8), "block_scale": ((M, K // 16), E4M3), "global_scale": ((), F32)},
        "columnwise": {"data": ((K, M // 2), U8), "block_scale": ((K, M // 16), E4M3), "global_scale": ((), F32)},
    }),
    "identity": (IdentityQuantizer(), {"rowwise": {"data": ((M, K), F32)}, "columnwise": {"data": ((K, M), F32)}}),
    "identity_bf16": (IdentityQuantizer(dtype=BF16), {
        "rowwise": {"data": ((M, K), BF16)}, "columnwise": {"data": ((K, M), BF16)},
    }),
}

DIRECTIONS = ("rowwise", "columnwise")


@pytest.fixture(scope="module")
def x():
    return torch.randn(2, M // 2, K, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_stored_layout(name, x):
    q, layout = LAYOUTS[name]
    t = q.quantize(x, state=q.make_state())
    assert t.shape == x.shape and t.dtype == x.dtype
    for d in DIRECTIONS:
        st = t.storage_of(d)
        assert st.transposed == (d == "columnwise"), f"{name} {d}"
        assert st.logical_shape2d == (M, K) and st.shape2d == ((K, M) if st.transposed else (M, K))
        assert set(st.TENSOR_FIELDS) == set(layout[d]), f"{name} {d} fields"
        for field, (shape, dtype) in layout[d].items():
            got = getattr(st, field)
            assert (tuple(got.shape), got.dtype) == (shape, dtype), f"{name} {d}.{field}"
        assert st.nbytes() == sum(v.numel() * v.element_size() for v in st.tensors().values())
        assert t.dequantize(d).shape == x.shape


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_one_direction_makes_only_that_direction(name, x):
    q, _ = LAYOUTS[name]
    both = q.quantize(x, state=q.make_state())
    for d in DIRECTIONS:
        other = "columnwise" if d == "rowwise" else "rowwise"
        one = q.quantize(x, rowwise=d == "rowwise", columnwise=d == "columnwise", state=q.make_state())
        assert one.storage_of(other) is None, f"{name}: asked {d} only, got {other} too"
        assert set(one.nbytes_by_direction()) == {d}
        with pytest.raises(ValueError, match=f"no {other} direction"):
            one.dequantize(other)
        if not getattr(q, "stochastic_rounding", False):  # SR draws depend on what else is made
            assert_storage_equal(one.storage_of(d), both.storage_of(d), f"{name} {d}-only == {d} of both")


EXACT_TRANSPOSE = ["fp8", "fp8_e5m2", "fp8_block_128x128", "nvfp4_2d", "identity", "identity_bf16"]
INDEPENDENT = ["fp8_block_1x128", "mxfp8", "nvfp4", "nvfp4_rht_sr"]


def _codes(st):
    """Element codes/values of a storage as a comparable [R, C] tensor."""
    if st.FORMAT == "nvfp4":
        return unpack_fp4(st.data)
    return st.data


@pytest.mark.parametrize("name", EXACT_TRANSPOSE)
def test_columnwise_is_the_exact_transpose(name, x):
    q, _ = LAYOUTS[name]
    t = q.quantize(x)
    row, col = t.rowwise, t.columnwise
    assert_bitwise_equal(_codes(col), _codes(row).t().contiguous(), f"{name} data")
    for f in row.TENSOR_FIELDS:
        if f != "data":
            a, b = getattr(row, f), getattr(col, f)
            assert_bitwise_equal(b, a.t().contiguous() if a.dim() == 2 else a, f"{name} {f}")
    assert torch.equal(t.dequantize("rowwise"), t.dequantize("columnwise"))


@pytest.mark.parametrize("name", INDEPENDENT)
def test_columnwise_is_an_independent_quantization(name, x):
    # With power-of-two block scales (1x128, MXFP8) the two directions agree on every value
    # that stays in E4M3's normal range; a loud row (x1e4) pushes the quiet values of every
    # column block it touches into the subnormal range, and only columnwise sees that.
    q, _ = LAYOUTS[name]
    x = x.clone()
    x[0, 0] *= 1e4
    t = q.quantize(x, state=q.make_state())
    assert not torch.equal(_codes(t.columnwise), _codes(t.rowwise).t().contiguous()), name
    assert not torch.equal(t.dequantize("rowwise"), t.dequantize("columnwise")), name


@pytest.mark.parametrize("name", ["fp8", "fp8_block_1x128", "fp8_block_128x128", "mxfp8", "nvfp4", "nvfp4_2d"])
def test_columnwise_equals_rowwise_of_the_transpose(name, x):
    # [Note: stored form]: columnwise quantization of x is rowwise quantization of x.T
    q, _ = LAYOUTS[name]
    x2d = x.reshape(M, K)
    col = q.quantize(x2d, rowwise=False).columnwise
    ref = q.quantize(x2d.t().contiguous(), columnwise=False).rowwise
    for f in col.TENSOR_FIELDS:
        assert_bitwise_equal(getattr(col, f), getattr(ref, f), f"{name} columnwise.{f} vs rowwise(x.T)")


def test_default_dequantize_uses_the_more_precise_direction(x):
    from hybrid_dist import HybridQuantizer

    q = HybridQuantizer(rowwise=MXFP8Quantizer(), columnwise=NVFP4Quantizer())
    t = q.quantize(x)
    assert torch.equal(t.dequantize(), t.dequantize("rowwise"))
    q2 = HybridQuantizer(rowwise=NVFP4Quantizer(), columnwise=Float8BlockQuantizer())
    t2 = q2.quantize(x)
    assert torch.equal(t2.dequantize(), t2.dequantize("columnwise"))
