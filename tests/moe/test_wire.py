"""``moe._wire``: one quantize pass over all slots gives, per expert, bitwise the rowwise
storage (and wire bytes) of quantizing that expert's rows alone with its amax, and the
receiver's unpack puts every row back where the per-expert storages have it."""

import pytest
import torch

import hybrid_dist as hd
from hybrid_dist.moe import _wire, device_split
from hybrid_dist.moe.split_quantize import padded_offsets

K = 256
COUNTS = [5, 0, 17, 1, 9, 32]  # an empty expert, a single row, an exact block
FORMATS = {
    "fp8_e4m3": hd.Float8Quantizer(),
    "fp8_e5m2": hd.Float8Quantizer(dtype=torch.float8_e5m2),
    "mxfp8": hd.MXFP8Quantizer(),
    "fp8_block_1x128": hd.Float8BlockQuantizer(block="1x128"),
    "nvfp4": hd.NVFP4Quantizer(),
    "identity": hd.IdentityQuantizer(),
    "hybrid_fp8_mxfp8": hd.HybridQuantizer(rowwise=hd.Float8Quantizer(), columnwise=hd.MXFP8Quantizer()),
}


def _bits(t):
    return t.reshape(-1).contiguous().view(torch.uint8)


def _slots(device="cpu"):
    torch.manual_seed(0)
    counts = torch.tensor(COUNTS, device=device)
    x = torch.randn(sum(COUNTS), K, dtype=torch.bfloat16) * torch.logspace(-3, 3, sum(COUNTS))[:, None]
    expert = torch.repeat_interleave(torch.arange(len(COUNTS), device=device), counts)
    return x.to(device), counts, expert, padded_offsets(counts, 1)[0]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", FORMATS)
def test_quantize_slots_is_bitwise_the_per_expert_quantize(name, device):
    """On CUDA: per-tensor FP8 through the Triton row cast and per-expert amax kernels, the
    per-expert reference through the registered quantize kernels."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    q = FORMATS[name]
    row_q = q.direction_quantizer("rowwise")
    x, counts, expert, offsets = _slots(device)
    chunks = x.split(COUNTS)
    amax = torch.stack([c.abs().amax().float() if c.numel() else torch.zeros((), device=device) for c in chunks])
    if row_q.is_per_tensor:  # the sender's one-pass amax is bitwise the per-expert one
        assert torch.equal(device_split.expert_amaxes(x, expert, len(COUNTS)), amax), f"{name}: per-expert amax"
    slots = _wire.quantize_slots(q, x, expert, offsets, amax if row_q.is_per_tensor else None)
    wire, start = _wire.pack(slots), 0
    for e, c in enumerate(chunks):
        ref, _ = row_q.quantize_storages(c, rowwise=True, columnwise=False, amax=amax[e])
        got = _wire.expert_rows(slots, e, start, c.shape[0])
        for f in ref.TENSOR_FIELDS:
            assert torch.equal(_bits(getattr(got, f)), _bits(getattr(ref, f))), f"{name} expert {e} field {f}"
        assert torch.equal(wire[start:start + c.shape[0]], _wire.pack(ref)), f"{name} expert {e}: wire bytes"
        start += c.shape[0]


@pytest.mark.parametrize("name", ["fp8_e4m3", "mxfp8", "nvfp4"])
def test_unpack_places_rows_in_the_padded_layout(name):
    q = FORMATS[name]
    x, counts, expert, offsets = _slots()
    amax = torch.stack([c.abs().amax().float() if c.numel() else torch.zeros(()) for c in x.split(COUNTS)])
    slots = _wire.quantize_slots(q, x, expert, offsets, amax)
    off, poff = padded_offsets(counts, 32)
    dest = torch.arange(x.shape[0]) - off[expert] + poff[expert]
    rows = _wire.unpack(_wire.pack(slots), slots, dest, int(poff[-1]))
    for e, m in enumerate(COUNTS):
        p0, p1 = int(poff[e]), int(poff[e + 1])
        got = _wire.expert_rows(rows, e, p0, p1 - p0)
        want = _wire.expert_rows(slots, e, int(off[e]), m)
        for f in got.TENSOR_FIELDS:
            g, w = getattr(got, f), getattr(want, f)
            if "R" in got.field_axes()[f]:
                assert torch.equal(_bits(g[:m]), _bits(w)), f"{name} expert {e} field {f}: rows"
                assert not _bits(g[m:]).any(), f"{name} expert {e} field {f}: padding must be zero bytes"
            else:
                assert torch.equal(g, w), f"{name} expert {e} field {f}: per-tensor field"


@pytest.mark.parametrize("q,need_columnwise,allowed", [
    (hd.MXFP8Quantizer(), True, True),  # requantized columnwise
    (hd.Float8BlockQuantizer(block="1x128"), True, True),
    (hd.Float8Quantizer(), True, True),  # derived: the transpose
    (hd.Float8Quantizer(scaling="delayed"), True, True),  # the exchange keeps the experts' states
    (hd.HybridQuantizer(rowwise=hd.IdentityQuantizer(), columnwise=hd.MXFP8Quantizer()), True, True),
    (hd.Float8BlockQuantizer(block="1x128", power_of_2_scales=False), True, False),  # values not exact
    (hd.Float8BlockQuantizer(block="1x128", power_of_2_scales=False), False, True),
    (hd.HybridQuantizer(rowwise=hd.MXFP8Quantizer(), columnwise=hd.NVFP4Quantizer(rht=True)), True, True),
    (hd.HybridQuantizer(rowwise=hd.MXFP8Quantizer(),  # columnwise SR: not made at the receiver
                        columnwise=hd.NVFP4Quantizer(rht=True, stochastic_rounding=True)), True, False),
    (hd.NVFP4Quantizer(rht=True), True, False),  # NVFP4 rows: values too coarse to quantize again
    (hd.HybridQuantizer(rowwise=hd.Float8Quantizer(), columnwise=hd.IdentityQuantizer()), True, False),
    (hd.HybridQuantizer(rowwise=hd.Float8Quantizer(), columnwise=hd.MXFP8Quantizer()), True, False),
    (hd.Float8BlockQuantizer(block="128x128"), False, False),  # rowwise blocks span 128 tokens
], ids=["mxfp8", "fp8_1x128", "fp8", "fp8_delayed", "identity_mxfp8", "fp8_1x128_no_pow2", "fp8_1x128_no_pow2_inference",
        "mxfp8_nvfp4", "mxfp8_nvfp4_sr", "nvfp4", "fp8_identity", "fp8_mxfp8", "fp8_128x128_inference"])
def test_which_formats_travel_quantized(q, need_columnwise, allowed):
    reason = _wire.unsupported_reason(q, need_columnwise=need_columnwise)
    assert (reason is None) == allowed, f"{q} need_columnwise={need_columnwise}: {reason}"
    if isinstance(q.direction_quantizer("columnwise"), hd.IdentityQuantizer) and not allowed:
        assert "high precision" in reason, reason  # why, not a block layout it does not have


def test_pack_of_one_field_is_a_view():
    """Per-tensor FP8 rows travel as the codes themselves (no copy); two fields are
    concatenated per row."""
    x = torch.randn(6, 64).bfloat16()
    fp8 = hd.Float8Quantizer().quantize_storages(x, rowwise=True, columnwise=False)[0]
    wire = _wire.pack(fp8)
    assert wire.data_ptr() == fp8.data.data_ptr() and wire.dtype == torch.uint8 and wire.shape == (6, 64)
    mx = hd.MXFP8Quantizer().quantize_storages(x, rowwise=True, columnwise=False)[0]
    assert _wire.pack(mx).shape == (6, 64 + 2)
