"""The op table of ``hd.QuantizedTensor`` (``_tensor_ops.py``) for every format and a
hybrid: detach/clone/_to_copy, legal and illegal views, dim-0 split/chunk/narrow/slice
(what FSDP2 shards with), allocation ops, ``copy_`` in every direction, ``cat``,
``as_strided``, unknown ops, flatten/unflatten, ``torch.save``/``torch.load(weights_only=True)``
and ``nn.Parameter`` wrapping."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hybrid_dist as hd
from hybrid_dist import QuantizedTensor
from hybrid_dist.formats._quantizer import tensor_amax
from tests._helpers import as_bits, assert_bitwise_equal, assert_storage_equal

DIRS = ("rowwise", "columnwise")

# id -> (quantizer, logical [M, K]); M is a multiple of every dim-0 block of the format.
FORMATS = {
    "fp8": (hd.Float8Quantizer(), (64, 32)),
    "fp8_e5m2_delayed": (hd.Float8Quantizer(dtype=torch.float8_e5m2, scaling="delayed"), (64, 32)),
    "fp8_block_1x128": (hd.Float8BlockQuantizer(), (256, 128)),
    "fp8_block_128x128": (hd.Float8BlockQuantizer(block="128x128"), (256, 128)),
    "mxfp8": (hd.MXFP8Quantizer(), (64, 32)),
    "nvfp4": (hd.NVFP4Quantizer(), (64, 32)),
    "nvfp4_2d": (hd.NVFP4Quantizer(block_2d=True), (64, 32)),
    "nvfp4_rht_sr": (hd.NVFP4Quantizer(rht=True, stochastic_rounding=True), (64, 32)),
    "identity": (hd.IdentityQuantizer(), (64, 32)),
    "hybrid_mxfp8_nvfp4": (hd.HybridQuantizer(rowwise=hd.MXFP8Quantizer(), columnwise=hd.NVFP4Quantizer()), (64, 32)),
}
NAMES = list(FORMATS)


def _x(name: str, seed: int = 0) -> torch.Tensor:
    return torch.randn(*FORMATS[name][1], generator=torch.Generator().manual_seed(seed))


def _quantize(name: str, x: torch.Tensor | None = None, **kw) -> QuantizedTensor:
    q = FORMATS[name][0]
    st = q.make_state()
    x = _x(name) if x is None else x
    if isinstance(q, hd.Float8Quantizer) and q.scaling == "delayed":
        q.quantize(x, state=st)
        q.advance_state(st)  # a primed state: scale from x's amax
    return q.quantize(x, state=st, **kw)


def _granularity(t: QuantizedTensor) -> int:
    return max(t.storage_of(d).dim0_granularity() for d in DIRS if t.storage_of(d) is not None)


def _assert_qt_equal(a: QuantizedTensor, b: QuantizedTensor, what: str) -> None:
    assert isinstance(a, QuantizedTensor) and isinstance(b, QuantizedTensor), what
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    for d in DIRS:
        assert_storage_equal(a.storage_of(d), b.storage_of(d), f"{what} {d}")


def _ptrs(t: QuantizedTensor) -> set[int]:
    return {x.data_ptr() for d in DIRS if t.storage_of(d) for x in t.storage_of(d).tensors().values()}


# --- detach / clone / _to_copy -------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_detach_shares_buffers_and_clone_copies_them(name):
    t = _quantize(name)
    d = t.detach()
    _assert_qt_equal(d, t, "detach")
    assert _ptrs(d) == _ptrs(t) and d.quantizer == t.quantizer
    c = t.clone()
    _assert_qt_equal(c, t, "clone")
    assert not (_ptrs(c) & _ptrs(t)), "clone must not share any buffer"
    c.zero_()
    assert not torch.equal(t.dequantize(), c.dequantize()), "zeroing the clone left the original"


@pytest.mark.parametrize("name", NAMES)
def test_to_dtype_dequantizes_and_device_moves_keep_the_subclass(name):
    t = _quantize(name)
    bf = t.to(torch.bfloat16)
    assert type(bf) is torch.Tensor and bf.dtype == torch.bfloat16
    assert_bitwise_equal(bf, t.dequantize(dtype=torch.bfloat16), f"{name} .to(bf16)")
    assert t.to(torch.float32) is t, "same dtype and device: no-op"
    copied = torch.ops.aten._to_copy.default(t)
    _assert_qt_equal(copied, t, "_to_copy")
    assert not (_ptrs(copied) & _ptrs(t))
    meta = t.to("meta")
    assert isinstance(meta, QuantizedTensor) and meta.device.type == "meta"
    assert all(x.device.type == "meta"
               for d in DIRS if meta.storage_of(d) for x in meta.storage_of(d).tensors().values())


# --- views ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["fp8", "mxfp8", "nvfp4", "hybrid_mxfp8_nvfp4"])
def test_views_of_leading_dims_are_legal(name):
    t = _quantize(name)
    m, k = t.shape
    v = t.view(2, m // 2, k)
    assert isinstance(v, QuantizedTensor) and v.shape == (2, m // 2, k)
    assert all(v.storage_of(d) is t.storage_of(d) for d in DIRS), "a view shares the storages"
    assert v.reshape(-1, k).shape == (m, k) and t.reshape(4, -1, k).shape == (4, m // 4, k)
    assert_bitwise_equal(v.dequantize(), t.dequantize().view(2, m // 2, k), "view dequantize")


@pytest.mark.parametrize("op,call", [
    ("aten.view", lambda t: t.view(32, 64)),  # changes the last dim
    ("aten.view", lambda t: t.reshape(2, -1)),  # last dim 1024
    ("aten.view", lambda t: t.view(2048, 1)),
    ("aten.t", lambda t: t.t()),
    ("aten.transpose", lambda t: t.transpose(0, 1)),
    ("aten.slice", lambda t: t[:, :16]),  # dim 1
    ("aten.slice", lambda t: t[::2]),  # step 2
    ("aten.split", lambda t: t.split(16, dim=1)),
    ("aten.select", lambda t: t[0]),
    ("aten.as_strided", lambda t: t.as_strided((32, 32), (32, 1))),
    ("aten.exp", torch.exp),
    ("aten.add", lambda t: t + 1),
    ("aten.mm", lambda t: t @ torch.ones(32, 2)),
    ("aten.sum", lambda t: t.sum()),
], ids=lambda v: v if isinstance(v, str) else "")
def test_illegal_or_unknown_ops_raise_naming_the_op(op, call):
    t = _quantize("mxfp8")
    with pytest.raises(NotImplementedError, match=op.replace(".", r"\.")):
        call(t)


def test_as_strided_same_size_and_stride_is_a_no_op():
    t = _quantize("nvfp4")
    s = t.as_strided(tuple(t.shape), tuple(t.stride()))
    assert isinstance(s, QuantizedTensor) and all(s.storage_of(d) is t.storage_of(d) for d in DIRS)


# --- dim-0 split / chunk / narrow / slice ------------------------------------------------------------

def _reference_piece(name: str, x: torch.Tensor, start: int, length: int) -> QuantizedTensor:
    """Quantization of the slice itself; per-tensor formats use the full tensor's amax."""
    q = FORMATS[name][0]
    amax = tensor_amax(x) if q.is_per_tensor else None
    if isinstance(q, hd.Float8Quantizer) and q.scaling == "delayed":
        return None  # scale comes from the state, checked through the storage slice
    return q.quantize(x[start:start + length], amax=amax)


@pytest.mark.parametrize("name", NAMES)
def test_dim0_split_chunk_narrow_slice_at_block_multiples(name):
    x = _x(name)
    t = _quantize(name, x)
    m = t.shape[0]
    g = _granularity(t)
    pieces = {
        "split": t.split(m // 2),
        "chunk": t.chunk(2),
        "split_with_sizes": t.split([m // 2 - g, m // 2 + g] if m // 2 > g else [m // 2, m // 2]),
    }
    narrow, sl = t.narrow(0, m // 2, m // 2), t[m // 2:]
    _assert_qt_equal(narrow, pieces["split"][1], f"{name} narrow vs split")
    _assert_qt_equal(sl, pieces["split"][1], f"{name} slice vs split")
    for how, parts in pieces.items():
        start = 0
        for p in parts:
            n = p.shape[0]
            assert isinstance(p, QuantizedTensor) and p.shape == (n, t.shape[1]), f"{name} {how}"
            for d in DIRS:  # a piece is exactly the storage's dim-0 slice (views, no copies)
                assert_storage_equal(p.storage_of(d), t.storage_of(d).narrow_dim0(start, n), f"{name} {how} {d}")
            ref = None if "rht" in name else _reference_piece(name, x, start, n)
            if ref is not None:  # ... and bitwise what quantizing that slice gives
                _assert_qt_equal(p, ref, f"{name} {how}[{start}:{start + n}] vs quantize(slice)")
            start += n
        _assert_qt_equal(torch.cat(list(parts)), t, f"{name} cat({how})")


def test_pieces_are_views_of_the_parent_buffers():
    t = _quantize("mxfp8")
    top = t.split(32)[1]
    assert top.rowwise.data.data_ptr() == t.rowwise.data[32:].data_ptr()
    top.zero_()
    assert int(t.rowwise.data[32:].view(torch.uint8).count_nonzero()) == 0
    assert int(t.rowwise.data[:32].view(torch.uint8).count_nonzero()) > 0


@pytest.mark.parametrize("name,bad", [
    ("mxfp8", lambda t: t[16:]), ("mxfp8", lambda t: t.split(16)), ("nvfp4", lambda t: t.narrow(0, 8, 16)),
    ("nvfp4_2d", lambda t: t[:40]), ("fp8_block_1x128", lambda t: t.chunk(4)),
    ("fp8_block_128x128", lambda t: t[64:]),
])
def test_misaligned_dim0_slices_raise(name, bad):
    t = _quantize(name)
    g = _granularity(t)
    with pytest.raises(NotImplementedError, match=f"multiples of {g} rows"):
        bad(t)


def test_per_tensor_fp8_slices_at_any_row():
    t = _quantize("fp8")
    p = t[5:12]
    assert p.shape == (7, 32)
    assert_bitwise_equal(p.dequantize(), t.dequantize()[5:12], "fp8 any-row slice")


def test_dim0_of_a_3d_tensor_slices_whole_rows_of_the_2d_view():
    x = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(3))
    t = hd.MXFP8Quantizer().quantize(x)
    a, b = t.split(2)  # 2 x 16 = 32 rows of [64, 32]: one 32-row column block each
    assert a.shape == (2, 16, 32)
    assert_bitwise_equal(b.dequantize(), t.dequantize()[2:], "3d split")
    with pytest.raises(NotImplementedError, match="multiples of 32"):
        t[1:]  # 16 rows: not a 32-row block boundary of the columnwise direction


@settings(max_examples=8, deadline=None)
@given(sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4))
def test_split_then_cat_is_the_identity(sizes):
    # pieces of 16 * s rows (NVFP4's column block), summing to M
    x = torch.randn(16 * sum(sizes), 32, generator=torch.Generator().manual_seed(sum(sizes)))
    t = hd.NVFP4Quantizer().quantize(x)
    parts = t.split([16 * s for s in sizes])
    assert [p.shape[0] for p in parts] == [16 * s for s in sizes]
    _assert_qt_equal(torch.cat(list(parts)), t, f"split{sizes} + cat")


# --- allocation ops ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_new_zeros_empty_like_zero_(name):
    t = _quantize(name)
    m, k = t.shape
    g = _granularity(t)
    z = t.new_zeros((2 * g, k))
    assert isinstance(z, QuantizedTensor) and z.shape == (2 * g, k) and z.quantizer == t.quantizer
    for d in DIRS:
        ref = t.storage_of(d).narrow_dim0(0, 2 * g) if m >= 2 * g else None
        for f, v in z.storage_of(d).tensors().items():
            assert v.dtype == getattr(t.storage_of(d), f).dtype
            assert not as_bits(v).any(), f"{name} new_zeros {d}.{f} not zero"
            if ref is not None:
                assert v.shape == getattr(ref, f).shape, f"{name} new_zeros {d}.{f}"
    e = torch.empty_like(t)
    assert isinstance(e, QuantizedTensor) and e.shape == t.shape
    for d in DIRS:
        assert {f: v.shape for f, v in e.storage_of(d).tensors().items()} == \
            {f: v.shape for f, v in t.storage_of(d).tensors().items()}
    assert not (_ptrs(e) & _ptrs(t))
    c = t.clone()
    assert c.zero_() is c
    assert all(not as_bits(v).any() for d in DIRS for v in c.storage_of(d).tensors().values())


def test_new_zeros_changing_the_inner_dims_raises():
    t = _quantize("mxfp8")
    with pytest.raises(NotImplementedError, match="differ in dim 0 only"):
        t.new_zeros((64, 64))


# --- copy_ ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_copy_qt_into_qt_copies_bitwise_into_the_same_buffers(name):
    src = _quantize(name, _x(name, seed=1))
    dst = _quantize(name)
    ptrs = _ptrs(dst)
    assert dst.copy_(src) is dst
    _assert_qt_equal(dst, src, f"{name} copy_")
    assert _ptrs(dst) == ptrs, "copy_ writes in place"


@pytest.mark.parametrize("name", [n for n in NAMES if "sr" not in n])
def test_copy_high_precision_into_qt_requantizes(name):
    dst = _quantize(name)
    hp = _x(name, seed=2)
    ptrs = _ptrs(dst)
    dst.copy_(hp)
    q = FORMATS[name][0]
    stateless = hd.Float8Quantizer(dtype=q.dtype) if isinstance(q, hd.Float8Quantizer) else q
    _assert_qt_equal(dst, stateless.quantize(hp), f"{name} copy_(hp)")  # delayed: current scaling
    assert _ptrs(dst) == ptrs


@pytest.mark.parametrize("name", NAMES)
def test_copy_qt_into_high_precision_dequantizes(name):
    t = _quantize(name)
    out = torch.empty(t.shape, dtype=torch.bfloat16)
    out.copy_(t)
    assert_bitwise_equal(out, t.dequantize(dtype=torch.bfloat16), f"{name} hp.copy_(qt)")


def test_copy_between_formats_requantizes_from_the_dequantized_source():
    src = _quantize("mxfp8")
    dst = _quantize("nvfp4", _x("nvfp4", seed=3))
    dst.copy_(src)
    _assert_qt_equal(dst, hd.NVFP4Quantizer().quantize(src.dequantize()), "mxfp8 -> nvfp4")


def test_copy_into_a_shard_writes_the_parent():
    t = _quantize("mxfp8")
    other = _quantize("mxfp8", _x("mxfp8", seed=4))
    t.split(32)[1].copy_(other.split(32)[1])
    for d in DIRS:
        assert_storage_equal(t.storage_of(d).narrow_dim0(32, 32), other.storage_of(d).narrow_dim0(32, 32), d)
    assert not torch.equal(t.rowwise.data[:32].view(torch.uint8), other.rowwise.data[:32].view(torch.uint8))


def test_copy_shape_mismatch_raises():
    with pytest.raises(ValueError, match=r"shape mismatch, dst \(64, 32\) vs src \(32, 32\)"):
        _quantize("mxfp8").copy_(torch.randn(32, 32))


# --- cat --------------------------------------------------------------------------------------------

def test_cat_dim0_of_separately_quantized_tensors():
    a, b = _quantize("mxfp8"), _quantize("mxfp8", _x("mxfp8", seed=5))
    c = torch.cat([a, b])
    assert c.shape == (128, 32)
    assert_bitwise_equal(c.dequantize(), torch.cat([a.dequantize(), b.dequantize()]), "cat")


def test_cat_with_different_per_tensor_scales_raises():
    a = hd.Float8Quantizer().quantize(torch.ones(4, 8))
    b = hd.Float8Quantizer().quantize(torch.ones(4, 8) * 2)
    with pytest.raises(ValueError, match="per-tensor field 'scale_inv' differs"):
        torch.cat([a, b])


def test_cat_along_dim1_or_with_missing_direction_raises():
    t = _quantize("mxfp8")
    with pytest.raises(NotImplementedError, match="aten.cat"):
        torch.cat([t, t], dim=1)
    row_only = hd.MXFP8Quantizer().quantize(_x("mxfp8"), columnwise=False)
    with pytest.raises(ValueError, match="every input needs the columnwise direction"):
        torch.cat([t, row_only])


# --- flatten / unflatten, save / load, Parameter ----------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_tensor_flatten_unflatten_round_trip(name):
    t = _quantize(name)
    names, ctx = t.__tensor_flatten__()
    expected = [f"{d}__{f}" for d in DIRS for f in t.storage_of(d).TENSOR_FIELDS]
    assert names == expected
    inner = {n: getattr(t, n) for n in names}  # inner tensors are reachable as attributes
    assert inner["rowwise__data"] is t.rowwise.data
    back = QuantizedTensor.__tensor_unflatten__(inner, ctx, t.shape, t.stride())
    _assert_qt_equal(back, t, f"{name} unflatten")
    assert back.quantizer == t.quantizer
    one = _quantize(name, rowwise=False)
    assert one.__tensor_flatten__()[0] == [f"columnwise__{f}" for f in one.columnwise.TENSOR_FIELDS]


def _save_load(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("name", NAMES)
def test_save_load_weights_only_round_trip_bitwise(name):
    t = _quantize(name)
    back = _save_load({"w": t, "view": t.view(2, -1, t.shape[-1])})
    _assert_qt_equal(back["w"], t, f"{name} torch.load")
    assert back["w"].quantizer == t.quantizer and back["view"].shape == (2, t.shape[0] // 2, t.shape[1])
    one = _quantize(name, columnwise=False)
    _assert_qt_equal(_save_load(one), one, f"{name} rowwise-only torch.load")


def test_save_load_keeps_requires_grad_and_bf16_dtype():
    q = hd.HybridQuantizer(rowwise=hd.Float8BlockQuantizer(block="128x128"), columnwise=hd.NVFP4Quantizer(rht=True))
    t = q.quantize(torch.randn(128, 128, dtype=torch.bfloat16)).requires_grad_(True)
    back = _save_load(t)
    assert back.requires_grad and back.dtype == torch.bfloat16 and back.quantizer == q
    _assert_qt_equal(back, t, "hybrid bf16")


def test_parameter_wrapping_keeps_the_subclass():
    t = _quantize("hybrid_mxfp8_nvfp4")
    p = torch.nn.Parameter(t)
    assert isinstance(p, QuantizedTensor) and isinstance(p, torch.nn.Parameter) and p.requires_grad
    assert _ptrs(p) == _ptrs(t)
    lin = torch.nn.Linear(32, 64, bias=False)
    lin.weight = p
    sd = lin.state_dict()
    assert isinstance(sd["weight"], QuantizedTensor)
    back = _save_load(sd)
    _assert_qt_equal(back["weight"], t, "state_dict round trip")
    fresh = torch.nn.Linear(32, 64, bias=False)
    fresh.weight = torch.nn.Parameter(_quantize("hybrid_mxfp8_nvfp4", _x("hybrid_mxfp8_nvfp4", seed=6)))
    fresh.load_state_dict(back)
    _assert_qt_equal(fresh.weight.detach(), t, "load_state_dict copies into the quantized parameter")


def test_split_sizes_must_cover_dim0():
    t = _quantize("mxfp8")
    with pytest.raises(ValueError, match=r"split sizes \[32\] must sum to dim 0's size 64"):
        t.split([32])


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4_2d", "fp8_block_1x128"])
def test_save_load_of_a_dim0_shard(name):
    t = _quantize(name)
    shard = t.chunk(2)[1]  # storages are views into the parent's buffers
    back = _save_load(shard)
    _assert_qt_equal(back, shard, f"{name} shard torch.load")
    assert_bitwise_equal(back.dequantize(), t.dequantize()[t.shape[0] // 2:], f"{name} shard values")


def test_flatten_context_follows_the_storages():
    """``__tensor_flatten__`` is kept per set of storage objects: hiding a direction (as the
    FSDP2 backward gather does) changes the names and the guard key."""
    t = _quantize("fp8")
    names, ctx = t.__tensor_flatten__()
    assert t.__tensor_flatten__()[1] is ctx  # kept, not rebuilt
    hidden, t._rowwise = t._rowwise, None
    names_1, ctx_1 = t.__tensor_flatten__()
    assert names_1 == [n for n in names if n.startswith("columnwise__")]
    assert not QuantizedTensor.__metadata_guard__(ctx, ctx_1)
    t._rowwise = hidden
    assert QuantizedTensor.__metadata_guard__(copy.deepcopy(ctx), t.__tensor_flatten__()[1])


def test_compiled_guard_recompiles_only_for_a_new_configuration():
    """Dynamo's metadata guard (``__metadata_guard__``): a tensor of the same format and
    quantizer reuses the graph; another quantizer configuration compiles a second one."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    fn = torch.compile(lambda t: t.dequantize(dtype=torch.float32) * 2, backend=counter, fullgraph=True)
    x = torch.randn(64, 64)
    e4m3 = hd.Float8Quantizer(dtype=torch.float8_e4m3fn)
    for t in (e4m3.quantize(x), e4m3.quantize(x * 3)):
        torch.testing.assert_close(fn(t), t.dequantize(dtype=torch.float32) * 2, rtol=0, atol=0)
    assert counter.frame_count == 1
    fn(hd.Float8Quantizer(dtype=torch.float8_e5m2).quantize(x))
    assert counter.frame_count == 2


@pytest.mark.parametrize("name", ["bf16", "fp8_fwd_bf16_bwd"])
def test_module_to_dtype_casts_high_precision_directions(name):
    """``quantized_model_init`` in fp32, then ``module.to(bf16)``: the identity directions
    become bf16 too (a columnwise view of the rowwise data stays one), so the GEMMs run in
    bf16 as they do for the same module made without quantized init."""
    recipe = hd.recipe_from_name(name)
    torch.manual_seed(0)
    with hd.quantized_model_init(recipe, keep_high_precision_init=False):
        q = hd.Linear(64, 32, bias=False, recipe=recipe)
    torch.manual_seed(0)
    plain = hd.Linear(64, 32, bias=False, recipe=recipe)
    q, plain = q.to(torch.bfloat16), plain.to(torch.bfloat16)
    w = q.weight
    for d in ("rowwise", "columnwise"):
        st = w.storage_of(d)
        if st.FORMAT == "identity":
            assert st.data.dtype == torch.bfloat16, f"{name} {d}: {st.data.dtype}"
    if name == "bf16":
        assert w.columnwise.data.data_ptr() == w.rowwise.data.data_ptr()
    # the bf16 directions' GEMMs equal those of the module made in bf16 (fp8_fwd_bf16_bwd's
    # FP8 forward quantized the fp32 init, so only its bf16 dgrad compares)
    x = torch.randn(16, 64).bfloat16()
    grads = []
    for m in (q, plain):
        xi = x.clone().requires_grad_(True)
        y = m(xi)
        y.backward(torch.ones_like(y))
        grads.append((y, xi.grad))
    assert torch.equal(grads[0][1], grads[1][1]), f"{name}: dgrad"
    assert name != "bf16" or torch.equal(grads[0][0], grads[1][0]), f"{name}: fprop"
