"""FP8 with 1×128 / 128×128 block scales (``formats/float8_block.py``) against hand-built
blocks."""

from __future__ import annotations

import torch

from hybrid_dist.formats import Float8BlockQuantizer, Float8BlockStorage
from tests._helpers import assert_bitwise_equal, assert_storage_equal

E4M3 = torch.float8_e4m3fn


def _scale_inv(amax: float, fmax: float = 448.0) -> float:
    """fp32 ``1 / (fmax / amax)``, computed in fp32 as the quantizer does."""
    return float(torch.reciprocal(torch.tensor(fmax) / torch.tensor(amax, dtype=torch.float32)))


def _blocky(m: int, k: int, br: int, amaxes: list[float]) -> torch.Tensor:
    """``[m, k]`` whose (br × 128) block ``i`` (row-major over blocks) has max |x| = amaxes[i]."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(m, k, generator=g) * 2 - 1  # |x| < 1
    nb_k = k // 128
    for i, a in enumerate(amaxes):
        r0, c0 = (i // nb_k) * br, (i % nb_k) * 128
        x[r0:r0 + br, c0:c0 + 128] *= a * 0.99
        x[r0, c0 + 5] = -a
    return x


def test_1x128_scales_per_row_block_pow2_default():
    amaxes = [3.0, 0.5, 448.0, 0.0]  # 2 rows x 2 blocks
    x = _blocky(2, 256, 1, amaxes)
    x[1, 128:] = 0.0
    st = Float8BlockQuantizer().quantize(x, columnwise=False).rowwise
    assert isinstance(st, Float8BlockStorage) and st.block_rows == 1
    assert st.scale_inv.shape == (2, 2) and st.scale_inv.dtype == torch.float32
    # pow2 scale = floor_pow2(448 / amax): 149.3 -> 128, 896 -> 512, 1 -> 1; amax 0 -> scale 1
    assert st.scale_inv.flatten().tolist() == [1 / 128, 1 / 512, 1.0, 1.0]
    assert int(st.data[1, 128:].view(torch.uint8).count_nonzero()) == 0


def test_1x128_exact_scales_without_pow2():
    x = _blocky(1, 256, 1, [3.0, 0.5])
    st = Float8BlockQuantizer(power_of_2_scales=False).quantize(x, columnwise=False).rowwise
    assert st.scale_inv.flatten().tolist() == [_scale_inv(3.0), _scale_inv(0.5)]
    # the block's amax element lands exactly on -448
    assert float(st.data[0, 5].float()) == -448.0 and float(st.data[0, 133].float()) == -448.0


def test_amax_epsilon_floors_each_block():
    x = _blocky(1, 256, 1, [1e-6, 2.0])
    st = Float8BlockQuantizer(power_of_2_scales=False, amax_epsilon=1e-3).quantize(x, columnwise=False).rowwise
    assert st.scale_inv.flatten().tolist() == [_scale_inv(1e-3), _scale_inv(2.0)]


def test_128x128_one_scale_per_tile_and_exact_transpose():
    amaxes = [3.0, 0.5, 8.0, 1.0, 100.0, 0.25]  # 2 x 3 tiles
    x = _blocky(256, 384, 128, amaxes)
    t = Float8BlockQuantizer(block="128x128").quantize(x)
    row, col = t.rowwise, t.columnwise
    assert row.block_rows == col.block_rows == 128
    assert row.data.shape == (256, 384) and row.scale_inv.shape == (2, 3)
    assert col.data.shape == (384, 256) and col.scale_inv.shape == (3, 2)
    assert row.scale_inv.flatten().tolist() == [1 / 128, 1 / 512, 1 / 32, 1 / 256, 1 / 4, 1 / 1024]
    assert_bitwise_equal(col.data, row.data.t().contiguous(), "128x128 columnwise data == rowwise.T")
    assert_bitwise_equal(col.scale_inv, row.scale_inv.t().contiguous(), "scales transposed")


def test_1x128_columnwise_is_rowwise_of_the_transpose_and_differs_from_rowwise():
    x = torch.randn(128, 256, generator=torch.Generator().manual_seed(1))
    x[3, :] *= 1e5  # one loud row: its amax sets every 128x1 column block's scale
    q = Float8BlockQuantizer()
    t = q.quantize(x)
    assert t.columnwise.data.shape == (256, 128) and t.columnwise.scale_inv.shape == (256, 1)
    ref = q.quantize(x.t().contiguous(), columnwise=False).rowwise
    assert_storage_equal(
        t.columnwise, Float8BlockStorage(data=ref.data, scale_inv=ref.scale_inv, block_rows=1, transposed=True),
        "1x128 columnwise == rowwise(x.T)",
    )
    row_dq, col_dq = t.dequantize("rowwise"), t.dequantize("columnwise")
    assert not torch.equal(row_dq, col_dq), "1x128 directions must be quantized independently"
    # columnwise, quiet rows fall below E4M3's subnormal range (1e5x under the block amax)
    quiet = torch.ones(128, dtype=torch.bool)
    quiet[3] = False
    row_err = (row_dq - x)[quiet].abs().mean()
    col_err = (col_dq - x)[quiet].abs().mean()
    assert col_err > 5 * row_err, (float(row_err), float(col_err))


def test_1x128_columnwise_only_needs_m_multiple_only():
    # K = 64 is not a multiple of 128, but the columnwise blocks run along M.
    x = torch.randn(128, 64, generator=torch.Generator().manual_seed(2))
    t = Float8BlockQuantizer().quantize(x, rowwise=False)
    assert t.rowwise is None and t.columnwise.scale_inv.shape == (64, 1)


def test_e5m2_blocks():
    x = _blocky(1, 128, 1, [2.0])
    st = Float8BlockQuantizer(dtype=torch.float8_e5m2).quantize(x, columnwise=False).rowwise
    assert st.data.dtype == torch.float8_e5m2
    assert st.scale_inv.tolist() == [[1 / 16384]]  # 57344 / 2 = 28672 -> 16384
