"""MXFP8 (``formats/mxfp8.py``): E8M0 block exponents and E4M3 elements of hand-built
32-element blocks; the two directions are independent quantizations."""

from __future__ import annotations

import torch

from hybrid_dist.formats import MXFP8Quantizer, MXFP8Storage
from tests._helpers import assert_storage_equal


def _row(values: list[float], fill: float = 0.0) -> torch.Tensor:
    """One 32-element block: ``values`` first, then ``fill``."""
    x = torch.full((32,), fill)
    x[: len(values)] = torch.tensor(values)
    return x


def test_hand_built_blocks():
    x = torch.stack([
        _row([1.0, 0.3, -0.5, 0.001]),  # amax 1: 1/448 -> 2**-8, e = 119
        _row([56.0, -7.0, 1.0]),  # amax 56 = 448 * 2**-3 exactly: e = 124, not rounded up
        _row([57.0, 3.0]),  # amax 57 > 56: rounded up to 2**-2, e = 125
        _row([]),  # amax 0: e = 0
    ]).reshape(1, 128)
    st = MXFP8Quantizer().quantize(x, columnwise=False).rowwise
    assert st.scale.dtype == torch.uint8 and st.scale.shape == (1, 4)
    assert st.scale.tolist() == [[119, 124, 125, 0]]
    d = st.data.float().reshape(4, 32)
    # block 0: x * 2**8; 0.3 * 256 = 76.8 -> 80 (E4M3 step 8 in [64, 128)); 0.001*256 = 0.256 -> 0.25
    assert d[0, :4].tolist() == [256.0, 80.0, -128.0, 0.25]
    # block 1: x * 8 -> 448 exactly (no saturation, the scale covers the amax)
    assert d[1, :3].tolist() == [448.0, -56.0, 8.0]
    # block 2: x * 4
    assert d[2, :2].tolist() == [224.0, 12.0]
    assert int(d[3].count_nonzero()) == 0
    dq = st.dequantize().reshape(4, 32)
    assert dq[0, :4].tolist() == [1.0, 0.3125, -0.5, 0.25 / 256]


def test_e5m2_elements_use_57344():
    x = _row([1.0, 0.7]).reshape(1, 32)
    st = MXFP8Quantizer(dtype=torch.float8_e5m2).quantize(x, columnwise=False).rowwise
    assert st.data.dtype == torch.float8_e5m2
    # 1 / 57344 = 2**-15.8 -> 2**-15, e = 112; 0.7 * 2**15 = 22937.6 -> 24576 (E5M2 step 4096)
    assert st.scale.tolist() == [[112]]
    assert st.data.float()[0, :2].tolist() == [32768.0, 24576.0]


def test_nan_block_gets_nan_exponent_and_spares_the_others():
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(0))
    x[0, 3] = float("nan")
    st = MXFP8Quantizer().quantize(x, columnwise=False).rowwise
    assert int(st.scale[0, 0]) == 255
    assert 0 < int(st.scale[0, 1]) < 255
    clean = MXFP8Quantizer().quantize(x[:, 32:].contiguous(), columnwise=False).rowwise
    assert torch.equal(st.data[:, 32:].view(torch.uint8), clean.data.view(torch.uint8))


def test_blocks_never_saturate_and_use_the_top_binade():
    # RCEIL: every block's scaled amax lies in (224, 448] (224 after E4M3 rounding): nothing clips.
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 3, 256)
    st = MXFP8Quantizer().quantize(x, columnwise=False).rowwise
    scaled_amax = st.data.float().abs().reshape(64, 8, 32).amax(-1)
    exact = (x.reshape(64, 8, 32).abs().amax(-1) / st.values().reshape(64, 8, 32).abs().amax(-1))
    assert bool((scaled_amax >= 224).all()) and bool((scaled_amax <= 448).all())
    assert torch.allclose(exact, torch.ones_like(exact), rtol=1 / 16, atol=0)  # E4M3 half-ulp


def test_layout_and_columnwise_is_rowwise_of_transpose():
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(2))
    x[5] *= 1000.0  # a loud row changes every 32x1 column block it touches
    q = MXFP8Quantizer()
    t = q.quantize(x)
    row, col = t.rowwise, t.columnwise
    assert (row.data.shape, row.scale.shape) == ((64, 96), (64, 3))
    assert (col.data.shape, col.scale.shape) == ((96, 64), (96, 2))
    assert row.data.dtype == col.data.dtype == torch.float8_e4m3fn
    assert row.scale.dtype == col.scale.dtype == torch.uint8
    ref = q.quantize(x.t().contiguous(), columnwise=False).rowwise
    assert_storage_equal(col, MXFP8Storage(data=ref.data, scale=ref.scale, transposed=True), "col == row(x.T)")
    assert not torch.equal(t.dequantize("rowwise"), t.dequantize("columnwise"))
    assert not torch.equal(col.data.view(torch.uint8), row.data.t().contiguous().view(torch.uint8))
    assert row.nbytes() == 64 * 96 + 64 * 3


def test_e8m0_exponent_is_ceil_log2_of_amax_over_448():
    # independent float64 reference: e = 127 + ceil(log2(amax / 448)) for blocks whose amax
    # spans 2**-40 .. 2**40 (including exact powers of two times 448)
    g = torch.Generator().manual_seed(3)
    amax = torch.cat([2.0 ** (torch.rand(200, generator=g) * 80 - 40), 448.0 * 2.0 ** torch.arange(-20.0, 21.0)])
    x = (torch.rand(len(amax), 32, generator=g) * 2 - 1) * amax[:, None]
    x[:, 7] = amax
    st = MXFP8Quantizer().quantize(x.reshape(1, -1), columnwise=False).rowwise
    expected = 127 + torch.ceil(torch.log2(amax.double() / 448.0)).long()
    assert torch.equal(st.scale.reshape(-1).long(), expected)
