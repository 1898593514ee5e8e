"""``quant_stats`` against a pure-torch computation from the storages' raw fields: amax and
every count (nonzero, underflow, saturated, block-scale histogram) bitwise, SQNR within
0.01 dB (computed here in float64 in the original domain, Hadamard transform undone)."""

from __future__ import annotations

import collections
import math

import pytest
import torch

import hybrid_dist as hd
from hybrid_dist.formats.numerics import E2M1_MAX, FP8_MAX, hadamard16
from hybrid_dist.inspection import HIST_LO, decode, quant_stats

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _codes_and_scales(st):
    """(element values before any scale [R, C], per-element multiplier [R, C], elem_max,
    per-block multipliers as a flat list) read from the raw fields."""
    kind = type(st).__name__
    r, c = st.shape2d
    if kind == "Float8Storage":
        s = st.scale_inv.float()
        return st.data.float(), s.expand(r, c), FP8_MAX[st.data.dtype], [float(s)]
    if kind == "Float8BlockStorage":
        s = st.scale_inv.float()
        el = s.repeat_interleave(st.block_rows, 0).repeat_interleave(128, 1)
        return st.data.float(), el, FP8_MAX[st.data.dtype], s.flatten().tolist()
    if kind == "MXFP8Storage":
        s = torch.pow(2.0, st.scale.double() - 127).float()
        return st.data.float(), s.repeat_interleave(32, 1), FP8_MAX[st.data.dtype], s.flatten().tolist()
    if kind == "NVFP4Storage":
        lo, hi = st.data & 0xF, st.data >> 4
        code = torch.stack([lo, hi], -1).reshape(r, c).long()
        val = E2M1[code & 7] * torch.where(code & 8 > 0, -1.0, 1.0)
        s = st.block_scale.float() * st.global_scale
        el = s.repeat_interleave(st.block_rows, 0).repeat_interleave(16, 1)
        return val, el, E2M1_MAX, s.flatten().tolist()
    if kind == "IdentityStorage":
        return st.data.float(), torch.ones(r, c), math.inf, []
    raise AssertionError(kind)


def reference_stats(x2d: torch.Tensor, st) -> dict:
    x = (x2d.t() if st.transposed else x2d).float()
    if getattr(st, "rht_seed", None) is not None:
        x = (x.reshape(x.shape[0], -1, 16) @ hadamard16(st.rht_seed).t()).reshape(x.shape)
    codes, mult, elem_max, blocks = _codes_and_scales(st)
    nz = x != 0
    x_ref, dq = x2d.double(), st.dequantize(torch.float64)
    noise = (x_ref - dq).pow(2).sum()
    hist = collections.Counter(
        0 if b == 0 else min(max(math.frexp(b)[1] - 1 - HIST_LO, 0), 127) for b in blocks)
    return {"amax": float(x.abs().max()), "nonzero": int(nz.sum()), "underflow": int((nz & (codes == 0)).sum()),
            "saturated": int((x.abs() > (mult * elem_max)).sum()) if blocks else 0,
            "sqnr_db": None if noise == 0 else float(10 * torch.log10(x_ref.pow(2).sum() / noise)),
            "hist": dict(hist)}


def _known_tensor(m: int = 256, k: int = 256) -> torch.Tensor:
    """Rows spread over 2**-24 .. 2**8 (many block scales), exact zeros, values far below
    their block's amax (flushed to zero) and a few outliers."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g) * torch.pow(2.0, torch.linspace(-24, 8, m)).unsqueeze(1)
    x[::7, ::5] = 0.0
    x[3::11, 1::9] *= 1e-6
    x[5::13, 2::17] *= 40.0
    return x


def _delayed_stale():
    """Delayed FP8 whose scale comes from a 64x smaller tensor: the values above it saturate."""
    q = hd.Float8Quantizer(dtype=torch.float8_e4m3fn, scaling="delayed")
    state = q.make_state()
    q.quantize_storages(_known_tensor() / 64, rowwise=True, columnwise=False, state=state)
    q.advance_state(state)
    return q, state


CASES = {
    "fp8_e4m3": (hd.Float8Quantizer(dtype=torch.float8_e4m3fn), None),
    "fp8_e5m2": (hd.Float8Quantizer(dtype=torch.float8_e5m2), None),
    "fp8_delayed_stale": "delayed",
    "fp8_block_1x128": (hd.Float8BlockQuantizer(block="1x128"), None),
    "fp8_block_128x128": (hd.Float8BlockQuantizer(block="128x128"), None),
    "mxfp8": (hd.MXFP8Quantizer(), None),
    "nvfp4": (hd.NVFP4Quantizer(), None),
    "nvfp4_rht": (hd.NVFP4Quantizer(rht=True), None),
    "nvfp4_2d": (hd.NVFP4Quantizer(block_2d=True), None),
    "identity": (hd.IdentityQuantizer(), None),
}


@pytest.mark.parametrize("direction", ["rowwise", "columnwise"])
@pytest.mark.parametrize("case", list(CASES))
def test_stats_equal_pure_torch(case, direction):
    q, state = _delayed_stale() if CASES[case] == "delayed" else CASES[case]
    x = _known_tensor()
    row, col = q.quantize_storages(x, rowwise=direction == "rowwise", columnwise=direction == "columnwise",
                                   state=state)
    st = row if direction == "rowwise" else col
    vec = quant_stats(x, st)
    got, ref = decode(vec.tolist()), reference_stats(x, st)
    assert vec.dtype == torch.float64 and vec[0].item() == ref["amax"], (vec[0].item(), ref["amax"])  # bitwise
    assert got["nonzero"] == ref["nonzero"] and got["numel"] == x.numel()
    assert got["underflow"] * ref["nonzero"] == pytest.approx(ref["underflow"], abs=1e-6)
    assert vec[4].item() == ref["underflow"] and vec[5].item() == ref["saturated"]
    hist = {got["scale_hist"]["log2_lo"] - HIST_LO + i: n for i, n in enumerate(got["scale_hist"]["counts"]) if n}
    assert hist == ref["hist"]
    if ref["sqnr_db"] is None:
        assert got["sqnr_db"] is None
    else:
        assert abs(got["sqnr_db"] - ref["sqnr_db"]) < 0.01, (got["sqnr_db"], ref["sqnr_db"])
    # the known tensor makes the statistics say something (so this test can fail)
    if case != "identity":
        spread = 0 if "fp8_e" in case or "delayed" in case else 1 if "128x128" in case else 10
        assert ref["underflow"] > 0 and len(hist) > spread
    if case in ("fp8_delayed_stale", "nvfp4", "nvfp4_rht", "nvfp4_2d"):
        assert ref["saturated"] > 0
    if case in ("fp8_e4m3", "mxfp8", "identity"):
        assert ref["saturated"] == 0


def test_no_reference_leaves_reference_fields_empty():
    """A quantized parameter (no high-precision tensor): amax and histogram of the
    dequantized tensor; SQNR, underflow and saturation are unknown (None)."""
    x = _known_tensor()
    row, _ = hd.MXFP8Quantizer().quantize_storages(x, rowwise=True, columnwise=False)
    got = decode(quant_stats(None, row).tolist())
    assert got["amax"] == float(row.dequantize().abs().max())
    assert got["sqnr_db"] is None and got["underflow"] is None and got["saturated"] is None
    assert sum(got["scale_hist"]["counts"]) == row.scale.numel()


def test_sharded_flag_sets_scope():
    x = _known_tensor(32, 64)
    row, _ = hd.MXFP8Quantizer().quantize_storages(x, rowwise=True, columnwise=False)
    assert decode(quant_stats(x, row).tolist())["scope"] == "full"
    assert decode(quant_stats(x, row, sharded=True).tolist())["scope"] == "shard"
