"""NVFP4 (``formats/nvfp4.py``): a hand-built block, 2D blocks, stochastic rounding
(unbiased, seeded) and the random Hadamard transform of the columnwise direction."""

from __future__ import annotations

import pytest
import torch

from hybrid_dist.formats import NVFP4Quantizer, NVFP4State, NVFP4Storage, traced_rng
from hybrid_dist.formats.nvfp4 import first_kernel_key
from hybrid_dist.formats.numerics import apply_hadamard16, hadamard16, unpack_fp4
from tests._helpers import assert_bitwise_equal, assert_storage_equal, sqnr_db

E4M3 = torch.float8_e4m3fn


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _block(values: list[float]) -> torch.Tensor:
    x = torch.zeros(16)
    x[: len(values)] = torch.tensor(values)
    return x


# Global amax 6 -> global_scale = fl(1/448) and 448 * global_scale == 1 exactly, so block 0
# (amax 6, block_scale 448) encodes x / 1 and block 1 (amax 3, block_scale 224) x / 0.5.
HAND_BLOCKS = [
    # (values, expected block scale, expected codes)
    ([6, -6, 0.5, 1.5, 2.5, -3.5, 0.2, 1.3, 5, 4.9, -0.75], 448.0,
     [7, 15, 1, 3, 4, 14, 0, 3, 6, 6, 10]),  # 2.5->2, -3.5->-4, 5->4 (ties to even)
    ([3, -1.1, 0.3, 0.2, 1.0, -2.9], 224.0, [7, 12, 1, 1, 4, 15]),  # x*2: 6, -2.2, .6, .4, 2, -5.8
    ([5, 2.0], 384.0, [7, 4]),  # 5/6*448 = 373.3 -> E4M3 384; 5*448/384 = 5.83 -> 6, 2.33 -> 2
    ([], 0.0, []),  # zero block: scale 0, codes 0
]


def test_hand_built_blocks_scales_codes_and_packing():
    x = torch.cat([_block(v) for v, _, _ in HAND_BLOCKS]).reshape(1, 64)
    st = NVFP4Quantizer().quantize(x, columnwise=False).rowwise
    assert st.global_scale.dtype == torch.float32 and st.global_scale.shape == ()
    assert float(st.global_scale) == float(torch.reciprocal(torch.tensor(448.0)))  # 1 / (448*6/6)
    assert st.block_scale.dtype == E4M3 and st.block_scale.shape == (1, 4)
    assert st.block_scale.float().tolist() == [[s for _, s, _ in HAND_BLOCKS]]
    codes = unpack_fp4(st.data).reshape(4, 16)
    for i, (_, _, expected) in enumerate(HAND_BLOCKS):
        assert codes[i].tolist() == expected + [0] * (16 - len(expected)), f"block {i}"
    # byte j = element 2j (low nibble) | element 2j+1 (high nibble)
    assert st.data.dtype == torch.uint8 and st.data.shape == (1, 32)
    assert st.data[0, :3].tolist() == [7 | 15 << 4, 1 | 3 << 4, 4 | 14 << 4]
    dq = st.dequantize().reshape(4, 16)
    assert torch.allclose(dq[0, :6], torch.tensor([6.0, -6, 0.5, 1.5, 2, -4]), rtol=1e-6, atol=0)
    assert torch.allclose(dq[1, :2], torch.tensor([3.0, -1.0]), rtol=1e-6, atol=0)


def test_global_scale_follows_amax_and_precomputed_amax():
    x = torch.cat([_block([12.0, 1.0])]).reshape(1, 16)
    q = NVFP4Quantizer()
    gs = float(q.quantize(x, columnwise=False).rowwise.global_scale)
    assert gs == float(torch.reciprocal(torch.tensor(2688.0) / torch.tensor(12.0)))  # 1/224
    gs2 = float(q.quantize(x, columnwise=False, amax=torch.tensor(24.0)).rowwise.global_scale)
    assert gs2 == float(torch.reciprocal(torch.tensor(2688.0) / torch.tensor(24.0)))  # 1/112


def test_zero_tensor():
    st = NVFP4Quantizer().quantize(torch.zeros(16, 32)).rowwise
    assert float(st.global_scale) == 1.0
    assert int(st.block_scale.float().count_nonzero()) == 0 and int(st.data.count_nonzero()) == 0


def test_layout_1d():
    t = NVFP4Quantizer().quantize(_randn(48, 64))
    row, col = t.rowwise, t.columnwise
    assert (row.data.shape, row.block_scale.shape) == ((48, 32), (48, 4))
    assert (col.data.shape, col.block_scale.shape) == ((64, 24), (64, 3))
    assert row.rht_seed is None and col.rht_seed is None and row.block_rows == col.block_rows == 1
    assert row.shape2d == (48, 64) and col.shape2d == (64, 48)
    assert row.nbytes() == 48 * 32 + 48 * 4 + 4


def test_columnwise_1d_is_rowwise_of_the_transpose():
    x = _randn(32, 48)
    q = NVFP4Quantizer()
    ref = q.quantize(x.t().contiguous(), columnwise=False).rowwise
    col = q.quantize(x, rowwise=False).columnwise
    assert_storage_equal(col, NVFP4Storage(**{**ref.tensors()}, block_rows=1, rht_seed=None, transposed=True), "col")
    assert not torch.equal(q.quantize(x).dequantize("rowwise"), q.quantize(x).dequantize("columnwise"))


# --- 2D blocks ------------------------------------------------------------------------------

def test_block_2d_layout_scale_per_tile_and_exact_transpose():
    x = _randn(32, 48, seed=1) * 0.1
    x[20, 5] = 3.0  # tile (1, 0) amax 3
    x[2, 40] = -6.0  # global amax 6, tile (0, 2)
    t = NVFP4Quantizer(block_2d=True).quantize(x)
    row, col = t.rowwise, t.columnwise
    assert row.block_rows == col.block_rows == 16
    assert (row.data.shape, row.block_scale.shape) == ((32, 24), (2, 3))
    assert (col.data.shape, col.block_scale.shape) == ((48, 16), (3, 2))
    assert float(row.block_scale[1, 0].float()) == 224.0 and float(row.block_scale[0, 2].float()) == 448.0
    assert_bitwise_equal(unpack_fp4(col.data), unpack_fp4(row.data).t().contiguous(), "codes transposed")
    assert_bitwise_equal(col.block_scale, row.block_scale.t().contiguous(), "scales transposed")
    assert_bitwise_equal(col.global_scale, row.global_scale, "global scale")
    assert torch.equal(t.dequantize("rowwise"), t.dequantize("columnwise"))
    # and it is what a 2D quantization of x.T gives
    ref = NVFP4Quantizer(block_2d=True).quantize(x.t().contiguous(), columnwise=False).rowwise
    assert_bitwise_equal(col.data, ref.data, "col == row2d(x.T)")


# --- stochastic rounding -------------------------------------------------------------------

# Values of a block with amax 6 (so the element encode scale is exactly 1), with their RTN bias.
SR_VALUES = [6.0, 2.4, 0.3, -1.3, 4.5, 3.3]
RTN_OF = [6.0, 2.0, 0.5, -1.5, 4.0, 3.0]


def test_stochastic_rounding_is_unbiased():
    n = 8192
    x = _block(SR_VALUES).repeat(n, 1)  # n independent draws of one fixed block
    q = NVFP4Quantizer(stochastic_rounding=True, seed=123)
    t = q.quantize(x, columnwise=False, state=q.make_state())
    dq = t.dequantize("rowwise")
    mean = dq.mean(0)[: len(SR_VALUES)]
    err = (mean - torch.tensor(SR_VALUES)).abs()
    # worst per-draw std is 2*sqrt(.25*.75) = 0.87 (4.5 between 4 and 6): std of the mean 0.0096
    assert float(err.max()) < 0.05, err.tolist()
    rtn = NVFP4Quantizer().quantize(x[:1], columnwise=False).dequantize("rowwise")[0, : len(SR_VALUES)]
    assert torch.allclose(rtn, torch.tensor(RTN_OF), rtol=1e-6, atol=0)  # 2688 * fl(1/448) ~ 6
    rtn_bias = (rtn - torch.tensor(SR_VALUES)).abs()
    assert bool((rtn_bias[1:] > 0.19).all())  # RTN is off by >= 0.2 on each; SR < 0.05
    # each draw of 2.4 lands on one of its two neighbours: codes 4 (2.0) and 5 (3.0)
    assert set(unpack_fp4(t.rowwise.data)[:, 1].unique().tolist()) == {4, 5}


def test_stochastic_rounding_reproducible_with_seed():
    x = _randn(32, 32, seed=2)
    q = NVFP4Quantizer(stochastic_rounding=True, seed=7)
    assert isinstance(q.make_state(), NVFP4State)
    a = q.quantize(x, state=q.make_state())
    b = q.quantize(x, state=q.make_state())
    for d in ("rowwise", "columnwise"):
        assert_storage_equal(a.storage_of(d), b.storage_of(d), f"same seed {d}")
    other = NVFP4Quantizer(stochastic_rounding=True, seed=8)
    c = other.quantize(x, state=other.make_state())
    assert not torch.equal(a.rowwise.data, c.rowwise.data), "a different seed gives other draws"
    st = q.make_state()
    first, second = q.quantize(x, state=st), q.quantize(x, state=st)
    assert not torch.equal(first.rowwise.data, second.rowwise.data), "the state's generator advances"


def test_kernel_key_starts_at_splitmix64_of_the_seed_and_advances_in_place():
    """The CUDA kernels' Philox key (``NVFP4State.kernel_key``): ``splitmix64(seed)`` to 63
    bits (splitmix64's first output from state 0 is 0xE220A8397B1DCDAF), one live tensor per
    device, advanced in place (what a CUDA-graph replay re-runs); the traced draw returns a
    copy of the key and advances the live one."""
    assert first_kernel_key(0) == 0xE220A8397B1DCDAF & (2**63 - 1)
    st = NVFP4Quantizer(stochastic_rounding=True, seed=7).make_state()
    cpu = torch.device("cpu")
    key = st.kernel_key(cpu)
    assert key.dtype == torch.int64 and key.shape == (1,) and key.item() == first_kernel_key(7)
    st.advance_kernel_key(cpu)
    assert st.kernel_key(cpu) is key and key.item() == first_kernel_key(7) + 1
    taken = traced_rng.state_rand(st, torch.zeros(1), (1,), draw=2, kind="key")
    assert taken.item() == first_kernel_key(7) + 1 and key.item() == first_kernel_key(7) + 2
    taken += 100  # a copy, not the live key
    assert key.item() == first_kernel_key(7) + 2
    keys = {first_kernel_key(s) for s in range(1000)}
    assert len(keys) == 1000 and min(keys) >= 0, "distinct, non-negative first keys"


def test_kernel_key_draw_through_the_traced_op_advances_per_call():
    """Under ``torch.compile`` the key is taken by the opaque ``hybrid_dist::state_rand`` op:
    each call of the compiled function returns the next key."""
    torch._dynamo.reset()
    st = NVFP4Quantizer(stochastic_rounding=True, seed=3).make_state()
    fn = torch.compile(lambda x: traced_rng.state_rand(st, x, (1,), draw=2, kind="key") + 0,
                       backend="aot_eager", fullgraph=True)
    got = [fn(torch.zeros(1)).item() for _ in range(3)]
    assert got == [first_kernel_key(3) + i for i in range(3)]
    assert st.kernel_key(torch.device("cpu")).item() == first_kernel_key(3) + 3


def test_no_state_without_stochastic_rounding():
    assert NVFP4Quantizer().make_state() is None
    x = _randn(16, 16)
    assert_storage_equal(NVFP4Quantizer().quantize(x).rowwise, NVFP4Quantizer().quantize(x).rowwise, "RTN")


# --- random Hadamard transform ----------------------------------------------------------------

def test_rht_columnwise_is_nvfp4_of_the_transformed_transpose():
    x = _randn(32, 48, seed=3)
    q = NVFP4Quantizer(rht=True, rht_seed=5)
    t = q.quantize(x)
    assert t.rowwise.rht_seed is None and t.columnwise.rht_seed == 5
    y = apply_hadamard16(x.t().contiguous(), hadamard16(5))  # [K, M], transformed along M
    ref = NVFP4Quantizer().quantize(y, columnwise=False).rowwise
    for f in ("data", "block_scale", "global_scale"):
        assert_bitwise_equal(getattr(t.columnwise, f), getattr(ref, f), f"rht columnwise.{f}")
    assert_storage_equal(t.rowwise, NVFP4Quantizer().quantize(x).rowwise, "rowwise untouched by rht")


def test_rht_columnwise_dequantizes_to_the_original_domain():
    x = _randn(64, 64, seed=4)
    t = NVFP4Quantizer(rht=True, rht_seed=1).quantize(x)
    col = t.columnwise
    assert sqnr_db(x, t.dequantize("columnwise")) > 19.0  # measured 20.4
    transformed = col.values(undo_rht=False) * col.global_scale  # [K, M] in the Hadamard domain
    y = apply_hadamard16(x.t().contiguous(), hadamard16(1))
    assert sqnr_db(y, transformed) > 19.0
    assert sqnr_db(x.t(), transformed) < 3.0, "undo_rht=False stays in the transformed domain"


def test_rht_seed_changes_only_the_columnwise_direction():
    x = _randn(32, 32, seed=5)
    a = NVFP4Quantizer(rht=True, rht_seed=0).quantize(x)
    b = NVFP4Quantizer(rht=True, rht_seed=1).quantize(x)
    assert_storage_equal(a.rowwise, b.rowwise, "rowwise")
    assert not torch.equal(a.columnwise.data, b.columnwise.data)


def test_rht_direction_uses_its_own_amax():
    x = _randn(32, 32, seed=6)
    q = NVFP4Quantizer(rht=True)
    a = q.quantize(x)
    b = q.quantize(x, amax=x.abs().amax() * 2)
    assert float(b.rowwise.global_scale) == pytest.approx(2 * float(a.rowwise.global_scale), rel=1e-6)
    assert_storage_equal(a.columnwise, b.columnwise, "rht columnwise ignores the precomputed amax")


def test_rht_with_2d_blocks_and_sr():
    x = _randn(32, 48, seed=8)
    q = NVFP4Quantizer(rht=True, block_2d=True, stochastic_rounding=True, seed=3)
    a = q.quantize(x, state=q.make_state())
    b = q.quantize(x, state=q.make_state())
    assert_storage_equal(a.columnwise, b.columnwise, "seeded rht+2d+sr")
    assert a.columnwise.rht_seed == 0 and a.columnwise.block_scale.shape == (3, 2)
    # with RHT, the columnwise direction is its own quantization, not the transpose
    assert not torch.equal(unpack_fp4(a.columnwise.data), unpack_fp4(a.rowwise.data).t())
    assert sqnr_db(x, a.dequantize("columnwise")) > 14.0


def test_rng_state_id_is_a_host_scalar_under_another_default_device():
    """The id a traced stochastic-rounding draw passes to its op is read on the host: it stays
    a CPU scalar when a CUDA (here meta) default device is set."""
    state = NVFP4Quantizer(stochastic_rounding=True, seed=7).make_state()
    with torch.device("meta"):
        uid = traced_rng.register(state)
    assert uid.device.type == "cpu" and traced_rng.registered_state(uid) is state
