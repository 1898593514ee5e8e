"""Per-tensor FP8 (``formats/float8.py``): scales against hand-computed values, layouts,
and the delayed-scaling state machine."""

from __future__ import annotations

import pytest
import torch

from hybrid_dist.formats import DelayedScalingState, Float8Quantizer, Float8Storage
from tests._helpers import assert_bitwise_equal

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _x(amax: float, shape=(4, 8)) -> torch.Tensor:
    """A deterministic [M, K] tensor whose max |x| is exactly ``amax`` (at a negative entry)."""
    x = torch.linspace(-0.9, 0.9, shape[0] * shape[1]).reshape(shape) * amax
    x[1, 2] = -amax
    return x


def _recip(scale: float) -> float:
    """fp32 ``1/scale`` (how ``scale_inv`` is stored)."""
    return float(torch.reciprocal(torch.tensor(scale, dtype=torch.float32)))


def _scale_inv(q: Float8Quantizer, x: torch.Tensor, **kw) -> float:
    return float(q.quantize(x, **kw).rowwise.scale_inv)


# --- current scaling ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,fmax", [(E4M3, 448.0), (E5M2, 57344.0)])
def test_current_scale_is_fp8_max_over_amax(dtype, fmax):
    q = Float8Quantizer(dtype=dtype)
    x = _x(2.0)
    t = q.quantize(x)
    scale = torch.tensor(fmax) / torch.tensor(2.0)
    assert float(t.rowwise.scale_inv) == float(torch.reciprocal(scale))
    # the amax element maps to exactly -fp8_max; data = sat(x * scale)
    assert float(t.rowwise.data[1, 2].float()) == -fmax
    assert_bitwise_equal(t.rowwise.data, (x * scale).to(dtype), "data")


def test_amax_zero_gives_scale_one_and_zero_data():
    t = Float8Quantizer().quantize(torch.zeros(4, 8))
    assert float(t.rowwise.scale_inv) == 1.0
    assert int(t.rowwise.data.view(torch.uint8).count_nonzero()) == 0


def test_power_of_2_scale_rounds_down():
    # 448 / 3 = 149.33 -> 128; the scale_inv is then exact: 1/128.
    assert _scale_inv(Float8Quantizer(power_of_2_scales=True), _x(3.0)) == 1.0 / 128
    # 448 / 0.5 = 896 -> 512
    assert _scale_inv(Float8Quantizer(power_of_2_scales=True), _x(0.5)) == 1.0 / 512
    # 448 / 448 = 1 is already a power of two
    assert _scale_inv(Float8Quantizer(power_of_2_scales=True), _x(448.0)) == 1.0


def test_amax_epsilon_floors_the_amax():
    q = Float8Quantizer(amax_epsilon=1e-2)
    expected = float(torch.reciprocal(torch.tensor(448.0) / torch.tensor(1e-2)))
    assert _scale_inv(q, _x(1e-4)) == expected  # amax below epsilon: epsilon used
    assert _scale_inv(q, _x(2.0)) == _recip(448.0 / 2)  # amax above epsilon: unchanged
    assert _scale_inv(q, torch.zeros(4, 8)) == expected  # eps also floors a zero amax


def test_precomputed_amax_overrides_the_local_one():
    # e.g. an amax all-reduced over shards: the local tensor's own amax (2) is ignored
    assert _scale_inv(Float8Quantizer(), _x(2.0), amax=torch.tensor(4.0)) == _recip(448.0 / 4)


def test_tiny_amax_scale_clamps_to_fp32_max():
    t = Float8Quantizer().quantize(_x(1e-44))
    assert float(t.rowwise.scale_inv) == float(torch.reciprocal(torch.tensor(torch.finfo(torch.float32).max)))
    assert bool(torch.isfinite(t.dequantize()).all())


def test_saturates_with_a_small_precomputed_amax():
    # amax=1 (too small) -> scale 448: 2.0 * 448 saturates to 448 instead of NaN
    t = Float8Quantizer().quantize(_x(2.0), amax=torch.tensor(1.0))
    assert float(t.rowwise.data.float().abs().max()) == 448.0
    assert not bool(torch.isnan(t.rowwise.data.float()).any())


# --- layout -----------------------------------------------------------------------------------

def test_layout_and_exact_transpose():
    x = torch.randn(2, 8, 24, generator=torch.Generator().manual_seed(0))  # M = 16, K = 24
    t = Float8Quantizer().quantize(x)
    row, col = t.rowwise, t.columnwise
    assert isinstance(row, Float8Storage) and isinstance(col, Float8Storage)
    assert (row.transposed, col.transposed) == (False, True)
    assert row.data.shape == (16, 24) and row.data.dtype == E4M3
    assert col.data.shape == (24, 16) and col.data.dtype == E4M3
    assert row.scale_inv.shape == () and row.scale_inv.dtype == torch.float32
    assert_bitwise_equal(col.data, row.data.t().contiguous(), "columnwise == rowwise.T")
    assert_bitwise_equal(col.scale_inv, row.scale_inv, "shared scale")
    assert row.logical_shape2d == col.logical_shape2d == (16, 24)
    assert row.nbytes() == 16 * 24 + 4


# --- delayed scaling ---------------------------------------------------------------------------

def test_delayed_without_state_raises():
    q = Float8Quantizer(scaling="delayed")
    with pytest.raises(ValueError, match="make_state"):
        q.quantize(_x(1.0))
    with pytest.raises(ValueError, match="make_state"):
        q.quantize(_x(1.0), state=object())


def test_delayed_first_pass_uses_scale_one_then_fp8_max_over_history_max():
    q = Float8Quantizer(scaling="delayed", amax_history_len=4)
    st = q.make_state()
    assert isinstance(st, DelayedScalingState)
    assert st.amax_history.tolist() == [0.0] * 4 and float(st.scale) == 1.0
    # pass 1: scale 1, records amax 2
    t = q.quantize(_x(2.0), state=st)
    assert float(t.rowwise.scale_inv) == 1.0
    assert_bitwise_equal(t.rowwise.data, _x(2.0).to(E4M3), "scale-1 data")
    q.advance_state(st)
    assert float(st.scale) == 448.0 / 2 and st.amax_history.tolist() == [0.0, 2.0, 0.0, 0.0]
    # pass 2: quantizes with 224; an amax-4 input saturates (4 * 224 > 448)
    t = q.quantize(_x(4.0), state=st)
    assert float(t.rowwise.scale_inv) == _recip(224.0)
    assert float(t.rowwise.data.float().abs().max()) == 448.0
    q.advance_state(st)
    assert float(st.scale) == 448.0 / 4 and st.amax_history.tolist() == [0.0, 4.0, 2.0, 0.0]
    # pass 3: a small amax does not lower the history max
    q.quantize(_x(1.0), state=st)
    q.advance_state(st)
    assert float(st.scale) == 448.0 / 4


def test_delayed_recording_is_a_running_max_and_idempotent():
    q = Float8Quantizer(scaling="delayed", amax_history_len=2)
    st = q.make_state()
    a = q.quantize(_x(3.0), state=st)
    b = q.quantize(_x(3.0), state=st)  # activation recompute: same input again
    q.quantize(_x(1.0), state=st)  # smaller amax in the same pass
    assert st.amax_history.tolist() == [3.0, 0.0]
    assert float(st.scale) == 1.0
    assert_bitwise_equal(a.rowwise.data, b.rowwise.data, "recompute")


def test_delayed_history_rolls_out_after_history_len_passes():
    q = Float8Quantizer(scaling="delayed", amax_history_len=2)
    st = q.make_state()
    scales = []
    for amax in (4.0, 1.0, 1.0):
        q.quantize(_x(amax), state=st)
        q.advance_state(st)
        scales.append(float(st.scale))
    assert scales == [112.0, 112.0, 448.0]


def test_delayed_most_recent_margin_and_pow2():
    st = Float8Quantizer(scaling="delayed").make_state()
    for amax_compute, margin, pow2, expected in [
        ("most_recent", 0, False, 448.0 / 1),
        ("max", 0, False, 448.0 / 4),
        ("max", 1, False, 448.0 / 4 / 2),
        ("max", 0, True, 64.0),  # 112 -> 64
        ("most_recent", 2, True, 64.0),  # 448 / 4 = 112 -> 64
    ]:
        q = Float8Quantizer(scaling="delayed", amax_compute=amax_compute, margin=margin,
                            power_of_2_scales=pow2, amax_history_len=4)
        st = q.make_state()
        for amax in (4.0, 1.0):  # pass 1 records 4, pass 2 records 1
            q.quantize(_x(amax), state=st)
            q.advance_state(st)
        assert float(st.scale) == expected, (amax_compute, margin, pow2)


def test_delayed_advance_with_empty_history_keeps_the_scale():
    q = Float8Quantizer(scaling="delayed")
    st = q.make_state()
    q.advance_state(st)
    assert float(st.scale) == 1.0
    q.quantize(_x(2.0), state=st)
    q.advance_state(st)
    q.advance_state(st)  # a pass that quantized nothing: still the max of the history
    assert float(st.scale) == 224.0


def test_delayed_state_dict_round_trip():
    q = Float8Quantizer(scaling="delayed", amax_history_len=3)
    st = q.make_state()
    q.quantize(_x(2.0), state=st)
    q.advance_state(st)
    st2 = q.make_state()
    st2.load_state_dict({k: v.clone() for k, v in st.state_dict().items()})
    assert st2.amax_history.tolist() == [0.0, 2.0, 0.0] and float(st2.scale) == 224.0
    x = _x(1.5)
    assert_bitwise_equal(q.quantize(x, state=st).rowwise.data, q.quantize(x, state=st2).rowwise.data, "data")


def test_current_scaling_has_no_state():
    assert Float8Quantizer().make_state() is None
    assert Float8Quantizer().is_per_tensor


def test_scale_is_one_correctly_rounded_division():
    # scale = fl(448 / amax), one IEEE division (what TE and the div_rn kernels compute);
    # torch's ``448.0 / tensor`` (reciprocal, then multiply) is off by 1 ulp for ~1/4 of amaxes.
    amaxes = torch.rand(64, generator=torch.Generator().manual_seed(0)) * 100 + 1e-3
    got = torch.stack([Float8Quantizer().quantize(_x(float(a))).rowwise.scale_inv for a in amaxes])
    expected = torch.reciprocal(torch.full_like(amaxes, 448.0) / amaxes)
    assert_bitwise_equal(got, expected, "scale_inv")


def test_delayed_empty_pass_keeps_the_scale_with_amax_epsilon():
    # most_recent + epsilon: a pass that records nothing must not set scale = 448 / eps
    q = Float8Quantizer(scaling="delayed", amax_compute="most_recent", amax_epsilon=1e-3)
    st = q.make_state()
    q.quantize(_x(2.0), state=st)
    q.advance_state(st)
    assert float(st.scale) == 224.0
    q.advance_state(st)  # this tensor was not quantized in that pass
    assert float(st.scale) == 224.0
    q.quantize(_x(1e-4), state=st)  # a recorded amax below epsilon: epsilon is used
    q.advance_state(st)
    assert float(st.scale) == float(torch.tensor(448.0) / torch.tensor(1e-3))
