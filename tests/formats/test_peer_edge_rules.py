"""Where hd's MXFP8 / NVFP4 edge cases meet TransformerEngine's and torchao's rules, and where
they deliberately differ (README "Edge cases against TE and torchao", docs/design.md §2).

Each peer rule is a small pure-torch reimplementation written from the peer's code:

* NVIDIA/TransformerEngine (main, Aug 2026): ``transformer_engine/common/util/ptx_arch_spec.cuh``
  ``float_to_e8m0`` (pre-Blackwell branch; Blackwell's ``cvt.rp.satfinite.ue8m0x2.f32``
  gives the same bytes), ``transformer_engine/common/util/ptx.cuh`` ``exp2f_rcp`` (since
  v2.13; up to v2.12 it returned 1 for exponent 0), ``cast/nvfp4/quantize_transpose_nvfp4.cuh``
  (``block_scale_inverse = fminf(1/(S_dec_b · S_dec), FLT_MAX)``), ``cast/nvfp4/core_nvfp4.cuh``
  (``compute_decoding_scaling_factor``: no lower clamp on the E4M3 block scale);
* pytorch/ao v0.18.0: ``torchao/prototype/mx_formats/mx_tensor.py`` ``_to_mx_rceil`` (inf amax
  → 254 with multiplier ``2**-127``, exponent 0 → multiplier 1), and the rewrite after it
  (main, #4725: ``_f32_to_e8m0_rceil``, ``_e8m0_scale_to_reciprocal_fp32``: inf → 255,
  exponent 0 → ``2**127``); ``torchao/prototype/mx_formats/nvfp4_tensor.py`` ``nvfp4_quantize``
  (block scale clamped to ``[finfo(e4m3).tiny = 2**-6, 448]``).
"""

from __future__ import annotations

import torch

import hybrid_dist as hd
from hybrid_dist.formats.numerics import e2m1_encode, pack_fp4

E4M3 = torch.float8_e4m3fn
FLT_MAX = torch.finfo(torch.float32).max


def _f32(bits: int) -> torch.Tensor:
    return torch.tensor([bits], dtype=torch.int32).view(torch.float32)


def _sat_e4m3(v: torch.Tensor) -> torch.Tensor:
    return v.clamp(-448.0, 448.0).to(E4M3)  # clamp keeps NaN, as a satfinite cast


# --- MXFP8 peers (rowwise, 1×32 blocks) ---------------------------------------------------

def te_mxfp8(x: torch.Tensor, *, before_v2_13: bool = False):
    """TE: ``e = float_to_e8m0(amax · (1/448))`` (RCEIL; NaN → 255, inf → 254, 0 → 0),
    ``data = satfinite(x · exp2f_rcp(e))``; ``exp2f_rcp``: 254 → ``2**-127``, else
    ``2**(127-e)`` (up to v2.12: 1 for ``e = 0``)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    v = blocks.abs().amax(-1) * torch.tensor(1 / 448, dtype=torch.float32)
    bits = v.view(torch.int32)
    exp, mant = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    up = (mant > 0) & (exp != 0xFE) & ~((exp == 0) & (mant <= 0x400000))
    e = torch.where(v == 0, 0, exp + up.to(torch.int32))
    e = torch.where(torch.isinf(v), 0xFE, torch.where(torch.isnan(v), 0xFF, e))
    rcp = ((254 - e).clamp(min=0) << 23).view(torch.float32)
    rcp = torch.where(e == 254, _f32(0x00400000), rcp)
    if before_v2_13:
        rcp = torch.where(e == 0, torch.ones_like(rcp), rcp)
    return _sat_e4m3(blocks * rcp[..., None]).reshape(x.shape), e.to(torch.uint8)


def torchao_018_mxfp8(x: torch.Tensor):
    """torchao 0.18 ``_to_mx_rceil`` (eager): ``e = clamp(ceil(log2(amax/448)), ±127) + 127``,
    NaN → 255, inf → 254; multiplier ``descale`` (255), ``2**-127`` (254), 1 (``e = 0``),
    else ``2**(127-e)``; ``data = clamp(x · m, ±448)``."""
    blocks = x.reshape(x.shape[0], -1, 32)
    descale = blocks.abs().amax(-1) / 448.0
    e = (torch.ceil(torch.log2(descale)).clamp(-127, 127) + 127).to(torch.uint8)
    e = torch.where(torch.isinf(descale), 254, torch.where(torch.isnan(descale), 255, e)).to(torch.uint8)
    m = torch.exp2(127 - e.to(torch.float32))
    m = torch.where(e == 0, 1.0, torch.where(e == 254, 2.0**-127, torch.where(e == 255, descale, m)))
    return _sat_e4m3(blocks * m[..., None]).reshape(x.shape), e


def torchao_main_mxfp8(x: torch.Tensor):
    """torchao main (#4725): ``_f32_to_e8m0_rceil(amax · (1/448))`` (non-finite → 255) and
    ``_e8m0_scale_to_reciprocal_fp32``: byte ``254 - e`` as E8M0 (0 → ``2**-127``, 255 → NaN)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    v = blocks.abs().amax(-1) * (1 / 448)
    bits = v.view(torch.int32)
    exp, mant = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    e = exp + torch.where(exp == 0, mant > 0x400000, mant != 0).to(torch.int32)
    e = torch.where(torch.isfinite(v), e, 255).to(torch.uint8)
    r = (254 - e.to(torch.int32)) & 0xFF
    m = torch.where(r == 0, 0x00400000, torch.where(r == 255, 0x7F800001, r << 23)).view(torch.float32)
    return _sat_e4m3(blocks * m[..., None]).reshape(x.shape), e


def _mxfp8_edge_input() -> torch.Tensor:
    """Rows of four blocks: ordinary values; values near 1e-36 (E8M0 exponent 0); an inf among
    ordinary values; zeros."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 128, generator=g) * 3
    x[:, 32:64] = torch.randn(4, 32, generator=g) * 5e-37  # amax/448 <= 2**-127: exponent 0
    x[:, 64] = float("inf")
    x[:, 96:] = 0.0
    return x


def test_mxfp8_edges_against_transformer_engine_and_torchao():
    x = _mxfp8_edge_input()
    st = hd.MXFP8Quantizer().quantize_storages(x, rowwise=True, columnwise=False)[0]
    data, scale = st.data.view(torch.uint8), st.scale
    assert scale[:, 1].eq(0).all() and data[:, 32:64].ne(0).any()  # exponent 0, data kept: x · 2**127
    assert torch.equal(st.data[:, 32:64].float(), _sat_e4m3(x[:, 32:64] * 2.0**127).float())
    assert scale[:, 2].eq(255).all() and scale[:, 3].eq(0).all()  # inf amax: 255 (E8M0 NaN)
    ordinary, exp0, inf_blk, zero = [slice(32 * i, 32 * i + 32) for i in range(4)]

    # TE main: bitwise but for the inf block's scale byte (254); its data bytes agree (x · 2**-127
    # and hd's x · 2**-128 both round to 0 for these values, inf saturates to 448 in both)
    te_data, te_scale = te_mxfp8(x)
    assert torch.equal(data, te_data.view(torch.uint8))
    assert torch.equal(scale[:, [0, 1, 3]], te_scale[:, [0, 1, 3]]) and te_scale[:, 2].eq(254).all()

    # TE up to v2.12 and torchao 0.18: also the exponent-0 block's data differs, flushed to ±0
    for peer_data, peer_scale in (te_mxfp8(x, before_v2_13=True), torchao_018_mxfp8(x)):
        peer_data = peer_data.view(torch.uint8)
        assert torch.equal(scale[:, [0, 1, 3]], peer_scale[:, [0, 1, 3]]) and peer_scale[:, 2].eq(254).all()
        for blk in (ordinary, inf_blk, zero):
            assert torch.equal(data[:, blk], peer_data[:, blk])
        assert (peer_data[:, exp0] & 0x7F).eq(0).all()

    # torchao main: hd's scale bytes everywhere (255 for inf); the inf block's data is NaN there
    ao_data, ao_scale = torchao_main_mxfp8(x)
    assert torch.equal(scale, ao_scale)
    for blk in (ordinary, exp0, zero):
        assert torch.equal(data[:, blk], ao_data.view(torch.uint8)[:, blk])
    assert ao_data[:, inf_blk].float().isnan().all()
    assert torch.equal(st.data[:, inf_blk].float(), _sat_e4m3(x[:, inf_blk] * 2.0**-128).float())


# --- NVFP4 peers (rowwise, 1×16 blocks, global scale 1) -----------------------------------

def te_nvfp4(x: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """TE's codes for given block scales: ``e2m1_satfinite(x · fminf(1/(bs · S_dec), FLT_MAX))``."""
    enc = torch.reciprocal(block_scale.float() * global_scale).clamp(max=FLT_MAX)
    scaled = x.reshape(x.shape[0], -1, 16) * enc[..., None]
    return pack_fp4(e2m1_encode(scaled.clamp(-6.0, 6.0).reshape(x.shape)))


def te_nvfp4_block_scale(x: torch.Tensor, amax: float) -> torch.Tensor:
    """``compute_decoding_scaling_factor``: ``e4m3(amax_b · (S_enc · (1/6)))``, no lower clamp."""
    s_enc = torch.tensor(min(448.0 * 6.0 / amax, FLT_MAX), dtype=torch.float32)
    return (x.reshape(x.shape[0], -1, 16).abs().amax(-1) * (s_enc * torch.tensor(1 / 6, dtype=torch.float32))
            ).to(E4M3)


def torchao_nvfp4(x: torch.Tensor, per_tensor_scale: torch.Tensor):
    """torchao ``nvfp4_quantize`` (two-level): ``bs = e4m3(clamp(amax_b/6/pts, 2**-6, 448))``,
    codes of ``clamp(x · ((1/pts) / bs), ±6)`` (RNE: ``f32_to_f4_unpacked``)."""
    blocks = x.reshape(x.shape[0], -1, 16)
    bs = (blocks.abs().amax(-1) / 6.0 / per_tensor_scale).clamp(min=torch.finfo(E4M3).tiny, max=448.0).to(E4M3)
    scaled = blocks * ((1.0 / per_tensor_scale) / bs.float())[..., None]
    return pack_fp4(e2m1_encode(scaled.clamp(-6.0, 6.0).reshape(x.shape))), bs


def _nvfp4_edge_input() -> torch.Tensor:
    """One row, tensor amax 2688 (global scale exactly 1): an ordinary block (scale 448), a
    zero block, a block of scale ``2**-8`` (E4M3 subnormal), a block whose ``amax/6`` is under
    ``2**-10`` (its E4M3 scale underflows to 0)."""
    x = torch.zeros(1, 64)
    x[0, :16] = torch.linspace(-2688.0, 2000.0, 16)
    x[0, 32:36] = torch.tensor([6.0, 0.5, -3.0, 1.0]) * 2.0**-8
    x[0, 48:50] = torch.tensor([2.0**-13, -(2.0**-14)])
    return x


def test_nvfp4_edges_against_transformer_engine_and_torchao():
    x = _nvfp4_edge_input()
    st = hd.NVFP4Quantizer().quantize_storages(x, rowwise=True, columnwise=False)[0]
    assert float(st.global_scale) == 1.0
    bs = st.block_scale.view(torch.uint8)[0].tolist()
    assert bs == [0x7E, 0x00, 0x02, 0x00]  # 448, zero block, 2**-8 (subnormal E4M3), underflow
    codes = st.data.view(torch.uint8)[0]

    # TE: the same block scales and, given them, the same codes, except in a non-zero block
    # whose scale underflowed to 0: TE's multiplier there is FLT_MAX (codes ±6), hd's 0
    # (codes ±0); both decode to 0
    assert torch.equal(te_nvfp4_block_scale(x, 2688.0).view(torch.uint8), st.block_scale.view(torch.uint8))
    te_codes = te_nvfp4(x, st.block_scale, st.global_scale).view(torch.uint8)[0]
    assert torch.equal(codes[:24], te_codes[:24])  # ordinary, zero and subnormal-scale blocks
    assert codes[24:].tolist() == [0x80] + [0] * 7  # 2**-13 → +0, -2**-14 → -0 (hd)
    assert te_codes[24:].tolist() == [0xF7] + [0] * 7  # → +6, -6 (TE)
    assert st.values()[0, 48:].eq(0).all()

    # torchao: ordinary blocks bitwise; scales below 2**-6 (zero blocks included) raised to 2**-6
    ao_codes, ao_bs = torchao_nvfp4(x, st.global_scale)
    ao_codes = ao_codes.view(torch.uint8)[0]
    assert ao_bs.view(torch.uint8)[0].tolist() == [0x7E, 0x08, 0x08, 0x08]
    assert torch.equal(codes[:8], ao_codes[:8]) and torch.equal(codes[8:16], ao_codes[8:16])
    # the 2**-8 block: hd codes 6, 0.5, -3, 1 (exact); torchao's (scale 2**-6) 1.5, 0, -1, 0:
    # 0.5 · 2**-8 is lost, -3 · 2**-8 becomes -4 · 2**-8 and 1 · 2**-8 rounds to 0 (ties to even)
    assert codes[16:18].tolist() == [0x17, 0x2D] and ao_codes[16:18].tolist() == [0x03, 0x0A]
    assert torch.equal(st.values()[0, 32:36], x[0, 32:36])
    assert ao_codes[24:].tolist() == [0x80] + [0] * 7  # 2**-13 · 64 and -2**-14 · 64 → ±0, as hd
    assert codes[8:16].eq(0).all() and ao_codes[8:16].eq(0).all()
