"""Bad input raises ``ValueError`` with a message naming what was received and what is
allowed: shapes that do not fit a block (the dim, its size and the multiple), non-float
or 1-D input, no direction asked, and invalid quantizer options."""

from __future__ import annotations

import re

import pytest
import torch

from hybrid_dist import HybridQuantizer
from hybrid_dist.formats import (
    Float8BlockQuantizer,
    Float8Quantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)

K_DIM, M_DIM = "K (last dim)", "M (prod of leading dims)"

# (id, quantizer, input shape, directions asked, dim named, its size, multiple needed)
SHAPE_CASES = [
    ("1x128_rowwise_K", Float8BlockQuantizer(), (128, 64), "rowwise", K_DIM, 64, 128),
    ("1x128_columnwise_M", Float8BlockQuantizer(), (64, 128), "columnwise", M_DIM, 64, 128),
    ("128x128_rowwise_M", Float8BlockQuantizer(block="128x128"), (192, 128), "rowwise", M_DIM, 192, 128),
    ("128x128_columnwise_K", Float8BlockQuantizer(block="128x128"), (128, 200), "columnwise", K_DIM, 200, 128),
    ("mxfp8_rowwise_K", MXFP8Quantizer(), (32, 48), "rowwise", K_DIM, 48, 32),
    ("mxfp8_columnwise_M", MXFP8Quantizer(), (3, 4, 32), "columnwise", M_DIM, 12, 32),
    ("nvfp4_rowwise_K", NVFP4Quantizer(), (16, 24), "rowwise", K_DIM, 24, 16),
    ("nvfp4_columnwise_M", NVFP4Quantizer(), (8, 16), "columnwise", M_DIM, 8, 16),
    ("nvfp4_2d_rowwise_M", NVFP4Quantizer(block_2d=True), (8, 16), "rowwise", M_DIM, 8, 16),
    ("nvfp4_rht_columnwise_M", NVFP4Quantizer(rht=True), (40, 16), "columnwise", M_DIM, 40, 16),
    ("hybrid_columnwise_M", HybridQuantizer(rowwise=Float8Quantizer(), columnwise=MXFP8Quantizer()),
     (16, 32), "columnwise", M_DIM, 16, 32),
]


@pytest.mark.parametrize("case", SHAPE_CASES, ids=[c[0] for c in SHAPE_CASES])
def test_non_multiple_shape_names_dim_size_and_multiple(case):
    _, q, shape, direction, dim, size, mult = case
    x = torch.randn(shape)
    message = rf"dim {re.escape(dim)} has size {size}, which is not a multiple of the {mult}"
    with pytest.raises(ValueError, match=rf"{direction}: {message}"):
        q.quantize(x, rowwise=direction == "rowwise", columnwise=direction == "columnwise")
    with pytest.raises(ValueError, match=rf"(rowwise|columnwise): {message}"):  # both asked: same error
        q.quantize(x)


def test_shape_checks_are_per_direction():
    # 1x128 columnwise blocks run along M: K = 64 is fine when only columnwise is asked
    assert Float8BlockQuantizer().quantize(torch.randn(128, 64), rowwise=False).columnwise is not None
    # MXFP8 rowwise needs only K % 32: M = 3 is fine
    assert MXFP8Quantizer().quantize(torch.randn(3, 32), columnwise=False).rowwise is not None
    # the hybrid's rowwise is per-tensor FP8: any shape
    q = HybridQuantizer(rowwise=Float8Quantizer(), columnwise=MXFP8Quantizer())
    assert q.quantize(torch.randn(3, 5), columnwise=False).rowwise.data.shape == (3, 5)


ALL_QUANTIZERS = [
    Float8Quantizer(), Float8BlockQuantizer(), MXFP8Quantizer(), NVFP4Quantizer(), IdentityQuantizer(),
]
IDS = ["fp8", "fp8_block", "mxfp8", "nvfp4", "identity"]


@pytest.mark.parametrize("q", ALL_QUANTIZERS, ids=IDS)
def test_one_d_input_raises(q):
    with pytest.raises(ValueError, match=r"at least 2 dims .*got shape \(128,\)"):
        q.quantize(torch.randn(128))


@pytest.mark.parametrize("q", ALL_QUANTIZERS, ids=IDS)
def test_non_float_input_raises(q):
    with pytest.raises(ValueError, match="floating-point tensor.*torch.int32"):
        q.quantize(torch.ones(128, 128, dtype=torch.int32))
    with pytest.raises(ValueError, match="floating-point tensor.*list"):
        q.quantize([[1.0] * 128] * 128)


@pytest.mark.parametrize("q", ALL_QUANTIZERS, ids=IDS)
def test_no_direction_raises(q):
    with pytest.raises(ValueError, match="at least one of rowwise / columnwise"):
        q.quantize(torch.randn(128, 128), rowwise=False, columnwise=False)


BAD_OPTIONS = [
    ("fp8_dtype", lambda: Float8Quantizer(dtype=torch.bfloat16),
     "float8_e4m3fn or torch.float8_e5m2, got torch.bfloat16"),
    ("fp8_scaling", lambda: Float8Quantizer(scaling="static"), "scaling must be 'current' or 'delayed', got 'static'"),
    ("fp8_amax_compute", lambda: Float8Quantizer(amax_compute="mean"), "amax_compute must be 'max' or 'most_recent'"),
    ("fp8_history_len", lambda: Float8Quantizer(amax_history_len=0), "amax_history_len must be >= 1"),
    ("fp8_epsilon", lambda: Float8Quantizer(amax_epsilon=-1.0), "amax_epsilon >= 0"),
    ("fp8_margin", lambda: Float8Quantizer(margin=-1), "margin >= 0"),
    ("block_shape", lambda: Float8BlockQuantizer(block="1x64"), "block must be '1x128' or '128x128', got '1x64'"),
    ("block_dtype", lambda: Float8BlockQuantizer(dtype=torch.float16), "got torch.float16"),
    ("mxfp8_dtype", lambda: MXFP8Quantizer(dtype=torch.uint8), "got torch.uint8"),
    ("identity_int", lambda: IdentityQuantizer(dtype=torch.int8), "floating dtype or None, got torch.int8"),
    ("identity_fp8", lambda: IdentityQuantizer(dtype=torch.float8_e4m3fn), "use Float8Quantizer"),
    ("hybrid_nested", lambda: HybridQuantizer(
        rowwise=HybridQuantizer(rowwise=MXFP8Quantizer(), columnwise=MXFP8Quantizer()), columnwise=MXFP8Quantizer()),
     r"rowwise=...\) must be a single-format quantizer"),
    ("hybrid_not_quantizer", lambda: HybridQuantizer(rowwise=MXFP8Quantizer(), columnwise="nvfp4"),
     r"columnwise=...\) must be a single-format quantizer .*got str"),
]


@pytest.mark.parametrize("case", BAD_OPTIONS, ids=[c[0] for c in BAD_OPTIONS])
def test_bad_options_raise_value_error(case):
    _, make, message = case
    with pytest.raises(ValueError, match=re.escape(message) if "\\" not in message else message):
        make()


def test_bad_direction_names_raise():
    t = MXFP8Quantizer().quantize(torch.randn(32, 32))
    with pytest.raises(ValueError, match="'rowwise' or 'columnwise', got 'diagonal'"):
        t.storage_of("diagonal")
    with pytest.raises(ValueError, match="'rowwise' or 'columnwise', got 'rows'"):
        MXFP8Quantizer().direction_quantizer("rows")


def test_configs_are_frozen_and_keyword_only():
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
        Float8Quantizer().dtype = torch.float8_e5m2
    with pytest.raises(TypeError):
        Float8Quantizer(torch.float8_e5m2)  # positional: not allowed
