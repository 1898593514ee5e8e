"""split_quantize: per-expert scales, padded layout, device offsets, packed form."""

import pytest
import torch

import hybrid_dist as hd
from hybrid_dist.moe import split_quantize, token_multiple
from hybrid_dist.moe.split_quantize import padded_offsets
from tests._helpers import assert_bitwise_equal, assert_storage_equal

SPLITS = [37, 0, 90, 73]
K = 64

QUANTIZERS = {
    "fp8": hd.Float8Quantizer(),
    "mxfp8": hd.MXFP8Quantizer(),
    "nvfp4_rht": hd.NVFP4Quantizer(rht=True),
    "fp8_block": hd.Float8BlockQuantizer(block="1x128"),
    "hybrid": hd.HybridQuantizer(rowwise=hd.MXFP8Quantizer(), columnwise=hd.NVFP4Quantizer()),
}


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_each_expert_equals_quantizing_its_padded_slice(name):
    q = QUANTIZERS[name]
    k = 128 if name == "fp8_block" else K
    torch.manual_seed(0)
    x = torch.randn(sum(SPLITS), k, dtype=torch.bfloat16)
    g = split_quantize(x, torch.tensor(SPLITS), [q] * len(SPLITS))
    mult = token_multiple(q)
    assert g.splits == SPLITS and g.padded_splits == [-(-m // mult) * mult for m in SPLITS]
    start = 0
    for e, m in enumerate(SPLITS):
        p = g.padded_splits[e]
        xe = torch.cat([x[start:start + m], x.new_zeros(p - m, k)])
        r, c = q.quantize_storages(xe, rowwise=True, columnwise=True)
        assert_storage_equal(g.rowwise[e], r, f"{name} expert {e} rowwise")
        assert_storage_equal(g.columnwise[e], c, f"{name} expert {e} columnwise")
        assert g.columnwise[e].shape2d == (k, p)
        start += m


def test_per_expert_per_tensor_scales():
    x = torch.cat([torch.full((8, K), 1.0), torch.full((8, K), 100.0)])
    g = split_quantize(x, torch.tensor([8, 8]), [hd.Float8Quantizer()] * 2)
    s = g.packed("rowwise")["scale_inv"]
    assert s.shape == (2,)
    assert_bitwise_equal(s, torch.tensor([1.0 / 448, 100.0 / 448]), "per-expert scale_inv")


def test_offsets_on_device_and_packed_layout():
    q = hd.MXFP8Quantizer()
    x = torch.randn(sum(SPLITS), K)
    tpe = torch.tensor(SPLITS)
    g = split_quantize(x, tpe, [q] * 4)
    off, poff = padded_offsets(tpe, 32)
    assert off.tolist() == [0, 37, 37, 127, 200] and poff.tolist() == [0, 64, 64, 160, 256]
    assert_bitwise_equal(g.padded_offsets, poff, "padded offsets")
    packed = g.packed("columnwise")
    assert packed["data"].shape == (K, 256) and packed["scale"].shape == (K, 256 // 32)
    # expert 2 = packed columns [poff_2, poff_3)
    assert_bitwise_equal(packed["data"][:, 64:160], g.columnwise[2].data, "packed expert 2")
    assert g.nbytes("rowwise") == 256 * K + 256 * K // 32


def test_states_per_expert_delayed():
    q = hd.Float8Quantizer(scaling="delayed")
    states = [q.make_state() for _ in range(2)]
    x = torch.cat([torch.full((4, K), 2.0), torch.full((4, K), 3.0)])
    split_quantize(x, torch.tensor([4, 4]), [q, q], states=states)
    assert [float(s.amax_history[0]) for s in states] == [2.0, 3.0]


def test_bad_inputs():
    q = hd.Float8Quantizer()
    with pytest.raises(ValueError, match="sum to"):
        split_quantize(torch.randn(10, K), torch.tensor([3, 3]), [q, q])
    with pytest.raises(ValueError, match="one per expert"):
        split_quantize(torch.randn(6, K), torch.tensor([3, 3]), [q])
    with pytest.raises(ValueError, match="1D int tensor"):
        split_quantize(torch.randn(6, K), torch.tensor([3.0, 3.0]), [q, q])
