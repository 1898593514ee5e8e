"""NVFP4 of a tiny tensor (amax below ``2688 / fp32 max`` ≈ 7.9e-36, global scale ``2**-128``):
the encode multiplier ``1 / (bs · gs)`` is clamped at the fp32 max, as TransformerEngine
clamps it, instead of overflowing to inf (which encoded every non-zero element as ±6).

The peer's rule, read from NVIDIA/TransformerEngine
``transformer_engine/common/cast/nvfp4/quantize_transpose_nvfp4.cuh`` (``block_scale_inverse =
fminf(1.0f / (S_dec_b_fp8 · S_dec), FLT_MAX)``) and ``core_nvfp4.cuh``
(``compute_global_encode_scaling_factor_FP4``: ``min(448·6 / amax, FLT_MAX)``): the encode
multiplier of each block. hd's block scale keeps its own IEEE formula (``amax_b / 6 / gs``;
TE multiplies by ``S_enc · (1/6)``), so the test feeds both the same block scales and
compares multipliers and codes.
"""

from __future__ import annotations

import pytest
import torch

import hybrid_dist as hd
from hybrid_dist.formats.numerics import e2m1_encode, pack_fp4
from hybrid_dist.formats.nvfp4 import NV_BLOCK

FLT_MAX = torch.finfo(torch.float32).max


def te_encode_multiplier(block_scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """TE's ``block_scale_inverse``: ``fminf(1 / (S_dec_b · S_dec), FLT_MAX)`` (an IEEE
    division; ``1/0 = inf`` clamps to ``FLT_MAX`` too)."""
    return torch.reciprocal(block_scale.float() * global_scale).clamp(max=FLT_MAX)


def _gaussian(amax: float, seed: int = 0) -> torch.Tensor:
    g = torch.randn(64, 256, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (g / g.abs().max() * amax).float()


def _sqnr_db(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    x, x_hat = x.double(), x_hat.double()
    return float(10 * torch.log10((x**2).sum() / ((x - x_hat) ** 2).sum()))


def _quantize(x: torch.Tensor):
    st = hd.NVFP4Quantizer().quantize_storages(x, rowwise=True, columnwise=False)[0]
    x_hat = st.values().double() * st.global_scale.double()  # exact: fp32 values times a power of two
    return st, x_hat


@pytest.mark.parametrize("amax", [1e-38, 1e-39, 1e-40])
def test_tiny_tensor_codes_are_te_rule_and_never_worse_than_zeros(amax):
    """Codes bitwise those of TE's clamped multiplier on hd's block scales; each element's
    error at most its magnitude (SQNR >= 0 dB; before the clamp: -3.3 dB at 1e-38)."""
    x = _gaussian(amax)
    st, x_hat = _quantize(x)
    assert float(st.global_scale) == 2.0**-128
    enc = te_encode_multiplier(st.block_scale, st.global_scale)
    assert (enc == FLT_MAX).any(), "the clamp is not exercised"
    blocks = x.reshape(64, 256 // NV_BLOCK, NV_BLOCK)
    te_codes = e2m1_encode((blocks * enc[..., None]).clamp(-6, 6).reshape(64, 256))
    assert torch.equal(st.data, pack_fp4(te_codes))
    assert bool(((x.double() - x_hat).abs() <= x.double().abs()).all())
    assert _sqnr_db(x, x_hat) >= 0.0


def test_the_clamp_reaches_only_tensors_below_the_fp32_range_of_the_multiplier():
    """Where every ``bs · gs`` stays at or above ``2**-128`` (here a tensor amax of 1e-37,
    global scale still ``2**-128``; the multiplier up to ``2**128`` but finite), the tiny tensor
    quantizes as well as the same tensor scaled by ``2**100`` (within 0.5 dB). Below (1e-38:
    block scales under 1, multipliers clamped), it cannot: the exact multiplier is not an fp32
    number; measured 3.3 dB against 20.4 dB."""
    x = _gaussian(1e-37)
    st, x_hat = _quantize(x)
    assert float(st.global_scale) == 2.0**-128
    assert float((st.block_scale.float() * st.global_scale).min()) >= 2.0**-128
    assert float((st.block_scale.float() * st.global_scale).min()) < 2.0**-126  # reciprocal above 2**126
    big = (x.double() * 2.0**100).float()
    assert _sqnr_db(x, x_hat) >= _sqnr_db(big, _quantize(big)[1]) - 0.5
    x = _gaussian(1e-38)
    tiny, big = _sqnr_db(x, _quantize(x)[1]), _sqnr_db((x.double() * 2.0**100).float(),
                                                      _quantize((x.double() * 2.0**100).float())[1])
    assert 3.0 < tiny < 4.0 and 20.0 < big < 21.0, (tiny, big)


def test_normal_range_unchanged_by_the_clamp():
    """For a tensor amax in the normal range the multiplier never reaches the fp32 max, so
    the clamp changes nothing: codes bitwise the unclamped reciprocal's."""
    for amax in (1e-30, 1.0, 1e30):
        x = _gaussian(amax, seed=1)
        st, _ = _quantize(x)
        denom = st.block_scale.float() * st.global_scale
        enc = torch.where(denom > 0, torch.reciprocal(denom), torch.zeros_like(denom))
        assert bool(torch.isfinite(enc).all()) and float(enc.max()) < FLT_MAX
        codes = e2m1_encode((x.reshape(64, -1, NV_BLOCK) * enc[..., None]).clamp(-6, 6).reshape(64, 256))
        assert torch.equal(st.data, pack_fp4(codes))
