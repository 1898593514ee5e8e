"""split_quantize_packed (no host sync) equals the reference split_quantize, bitwise."""

import pytest
import torch

import hybrid_dist as hd
from hybrid_dist.moe import split_quantize
from hybrid_dist.moe.device_split import split_quantize_packed
from tests._helpers import assert_bitwise_equal, sqnr_db

SPLITS = [37, 0, 90, 73, 1]
QUANTIZERS = {
    "fp8_current": hd.Float8Quantizer(),
    "fp8_delayed": hd.Float8Quantizer(scaling="delayed"),
    "fp8_e5m2_pow2": hd.Float8Quantizer(dtype=torch.float8_e5m2, power_of_2_scales=True),
    "mxfp8": hd.MXFP8Quantizer(),
    "fp8_block_1x128": hd.Float8BlockQuantizer(block="1x128"),
    "identity": hd.IdentityQuantizer(),
    "nvfp4": hd.NVFP4Quantizer(),
    "nvfp4_rht": hd.NVFP4Quantizer(rht=True, rht_seed=3),
    "hybrid_mxfp8_nvfp4": hd.HybridQuantizer(rowwise=hd.MXFP8Quantizer(), columnwise=hd.NVFP4Quantizer(rht=True)),
    "hybrid_fp8_mxfp8": hd.HybridQuantizer(rowwise=hd.Float8Quantizer(), columnwise=hd.MXFP8Quantizer()),
}


def _compare(name, q, device="cpu"):
    torch.manual_seed(0)
    x = torch.randn(sum(SPLITS), 128, dtype=torch.bfloat16, device=device)
    x[40:45] *= 50  # experts get different amaxes
    tpe = torch.tensor(SPLITS, device=device)
    st_ref = [q.make_state() for _ in SPLITS]
    st_dev = [q.make_state() for _ in SPLITS]
    for s in st_ref + st_dev:  # delayed: start from a non-trivial scale
        q.advance_state(s)
    ref = split_quantize(x, tpe, [q] * len(SPLITS), states=st_ref)
    got = split_quantize_packed(x, tpe, q, states=st_dev)
    assert_bitwise_equal(got.padded_offsets, ref.padded_offsets, f"{name} padded offsets")
    t_pad = int(ref.padded_offsets[-1])
    assert got.capacity >= t_pad
    for direction, axis in (("rowwise", 0), ("columnwise", 1)):
        want, have = ref.packed(direction), getattr(got, direction)
        for f, w in want.items():
            h = have[f] if w.dim() == 1 else have[f].narrow(axis, 0, w.shape[axis])
            assert_bitwise_equal(h, w, f"{name} {direction}.{f}")
    if isinstance(st_ref[0], hd.DelayedScalingState):
        for a, b in zip(st_ref, st_dev):
            assert_bitwise_equal(a.amax_history, b.amax_history, f"{name} recorded amax")


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_packed_equals_reference(name):
    _compare(name, QUANTIZERS[name])


def test_nvfp4_2d_blocks_not_supported():
    q = hd.NVFP4Quantizer(block_2d=True)
    with pytest.raises(NotImplementedError, match="split_quantize"):
        split_quantize_packed(torch.randn(32, 64), torch.tensor([16, 16]), q)


def test_packed_stochastic_rounding_per_expert_scales():
    """SR: per-expert global scales equal the reference's (they depend on amax only); the
    codes are stochastic (differ from round-to-nearest) and unbiased on average."""
    q_sr, q_rn = hd.NVFP4Quantizer(rht=True, stochastic_rounding=True), hd.NVFP4Quantizer(rht=True)
    torch.manual_seed(0)
    x = torch.randn(sum(SPLITS), 128)
    tpe = torch.tensor(SPLITS)
    states = [q_sr.make_state() for _ in SPLITS]
    got = split_quantize_packed(x, tpe, q_sr, states=states)
    rn = split_quantize_packed(x, tpe, q_rn)
    for d in ("rowwise", "columnwise"):
        fields = getattr(got, d)
        assert_bitwise_equal(fields["global_scale"], getattr(rn, d)["global_scale"], f"SR {d} global scales")
        assert not torch.equal(fields["data"], getattr(rn, d)["data"]), f"SR {d}: codes equal round-to-nearest"
    def dequantized(p):
        from hybrid_dist.formats.nvfp4 import NVFP4Storage

        row = p.rowwise
        st = NVFP4Storage(data=row["data"], block_scale=row["block_scale"], global_scale=row["global_scale"],
                          block_rows=1, rht_seed=None, transposed=False)
        return (st.values() * torch.cat([row["global_scale"], torch.ones(1)])[p.row_expert][:, None])[p.dest]

    # unbiased: the mean of 16 SR draws is much closer to x than one round-to-nearest
    mean = sum(dequantized(split_quantize_packed(x, tpe, q_sr, states=states, columnwise=False))
               for _ in range(16)) / 16
    sr_db, rn_db = sqnr_db(x, mean), sqnr_db(x, dequantized(rn))
    assert sr_db > rn_db + 6, f"mean of 16 SR draws {sr_db:.1f} dB vs round-to-nearest {rn_db:.1f} dB"


@pytest.mark.parametrize("name", ["nvfp4", "nvfp4_rht", "hybrid_mxfp8_nvfp4", "nvfp4_rht_sr"])
def test_packed_nvfp4_per_expert_slices_equal_reference(name, monkeypatch):
    """The eager CUDA form of the NVFP4 packed split (one quantize call per non-empty expert
    segment for every direction at once, ``_per_expert_nvfp4_slices``), forced on CPU where
    each call is the reference quantizer: bitwise ``split_quantize``, stochastic rounding
    included (each expert's segment from its own state, as ``split_quantize`` draws); one
    slice split per packed split (an NVFP4 quantizer's two directions together)."""
    from hybrid_dist.moe import device_split

    q = hd.NVFP4Quantizer(rht=True, rht_seed=3, stochastic_rounding=True) if name == "nvfp4_rht_sr" \
        else QUANTIZERS[name]
    monkeypatch.setattr(device_split, "_nvfp4_slices_fit", lambda x, per_expert_draws: not per_expert_draws)
    calls = []
    real = device_split._per_expert_nvfp4_slices
    monkeypatch.setattr(device_split, "_per_expert_nvfp4_slices", lambda *a, **k: calls.append(1) or real(*a, **k))
    _compare(name, q)
    assert len(calls) == 1, f"{name}: {len(calls)} slice splits (both directions of one quantizer: one)"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["nvfp4", "nvfp4_rht", "hybrid_mxfp8_nvfp4"])
def test_packed_nvfp4_cuda_eager_equals_reference(name):
    """Eager on CUDA the NVFP4 packed split runs the dense kernels per expert segment (one
    host read of the offsets): bitwise ``split_quantize``, which runs them per expert too."""
    _compare(name, QUANTIZERS[name], device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fp8_current", "mxfp8", "fp8_block_1x128", "hybrid_fp8_mxfp8"])
def test_packed_cuda_no_host_sync(name):
    q = QUANTIZERS[name]
    x = torch.randn(sum(SPLITS), 128, dtype=torch.bfloat16, device="cuda")
    tpe = torch.tensor(SPLITS, device="cuda")
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        split_quantize_packed(x, tpe, q)
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    _compare(name, q, device="cuda")  # and equal to the reference on CUDA


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_packed_fp8_rows_equals_packed_quantize(dtype, device):
    """``packed_fp8_rows`` (the expert-parallel receiver: codes quantized per expert by the
    sender, placed into the packed layout; on CUDA by ``kernels.fp8.rows.place_codes``) is
    bitwise ``split_quantize_packed`` of the high-precision rows, both directions and the
    index tensors, zero-token experts included."""
    from hybrid_dist.formats._quantizer import tensor_amax
    from hybrid_dist.moe.device_split import packed_fp8_rows

    q = hd.Float8Quantizer(dtype=dtype)
    splits = [37, 0, 90, 73, 0]
    torch.manual_seed(0)
    x = (torch.randn(sum(splits), 64) * torch.linspace(0.1, 30, sum(splits))[:, None]).bfloat16().to(device)
    tpe = torch.tensor(splits, device=device)
    ref = split_quantize_packed(x, tpe, q, rowwise=True, columnwise=True, multiple=16)
    sent = [q.quantize_storages(c, rowwise=True, columnwise=False, amax=tensor_amax(c))[0]
            for c in torch.split(x, splits)]
    got = packed_fp8_rows(torch.cat([s.data for s in sent]), torch.stack([s.scale_inv.reshape(()) for s in sent]),
                          tpe, 16, columnwise=True)
    for d in ("rowwise", "columnwise"):
        for f in ("data", "scale_inv"):
            assert_bitwise_equal(getattr(got, d)[f], getattr(ref, d)[f], f"{dtype} {d}.{f}")
    for f in ("offsets", "padded_offsets", "dest", "row_expert"):
        assert torch.equal(getattr(got, f), getattr(ref, f)), f"{dtype} {f}"
    assert (got.capacity, got.multiple) == (ref.capacity, ref.multiple)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_place_rows_is_index_copy_into_zeros(device):
    """``place_rows`` (the expert-parallel receiver's placement of wire rows; on CUDA
    ``kernels.fp8.rows.place_codes``): the rows on their packed rows, zero bytes in the
    padding, and the index tensors of ``split_quantize_packed``'s layout; with ``src``,
    token t from row ``src[t]``."""
    from hybrid_dist.moe.device_split import place_rows

    splits = [37, 0, 90, 73, 0]
    gen = torch.Generator().manual_seed(3)
    rows = torch.randint(0, 256, (sum(splits), 70), generator=gen, dtype=torch.uint8).to(device)  # 70: K + K/32 bytes
    tpe = torch.tensor(splits, device=device)
    placed, placed_t, g = place_rows(rows, tpe, 32, columnwise=True)
    ref = split_quantize_packed(torch.zeros(sum(splits), 64, device=device), tpe, hd.MXFP8Quantizer(),
                                rowwise=True, columnwise=False, multiple=32)
    for f in ("offsets", "padded_offsets", "dest", "row_expert"):
        assert torch.equal(getattr(g, f), getattr(ref, f)), f
    assert (g.capacity, g.multiple, g.rowwise, g.columnwise) == (ref.capacity, 32, None, None)
    want = rows.new_zeros(g.capacity, rows.shape[1]).index_copy_(0, ref.dest, rows)
    assert_bitwise_equal(placed, want, f"placed rows ({device})")
    assert_bitwise_equal(placed_t, want.t().contiguous(), f"placed rows, transposed ({device})")
    assert place_rows(rows, tpe, 32)[1] is None
    src = torch.randperm(sum(splits), generator=gen).to(device)  # token t from row src[t] (a receiver's regroup)
    placed, placed_t, _ = place_rows(rows, tpe, 32, columnwise=True, src=src)
    want = rows.new_zeros(g.capacity, rows.shape[1]).index_copy_(0, ref.dest, rows[src])
    assert_bitwise_equal(placed, want, f"placed rows through src ({device})")
    assert_bitwise_equal(placed_t, want.t().contiguous(), f"placed rows through src, transposed ({device})")
