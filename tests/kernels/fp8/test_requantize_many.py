"""The batched FP8 write-back's host side on CPU, with the kernel launches recorded instead of
run: a constant number of launches for any number of parameters, pointer tables cached by
address (and rebuilt when a buffer moves), the pairs it cannot serve left to ``requantize_``,
and ``MasterWeightOptimizer`` handing all its quantized parameters over in one call. The
kernels' numbers: ``tests/kernels/fp8/test_multi.py`` (interpreter and GPU)."""

from __future__ import annotations

import pytest
import torch

import hybrid_dist as hd

pytest.importorskip("triton")

SHAPES = [(72, 200), (1, 130), (65, 129), (128, 64), (3, 5), (40, 64), (256, 96), (2, 33, 64)]


@pytest.fixture
def launches(monkeypatch):
    """The kernel launches of ``fp8.multi``, recorded as ``(kernel name, grid, args, consts)``."""
    from hybrid_dist.kernels.fp8 import multi as fp8_multi

    calls = []
    monkeypatch.setattr(fp8_multi, "launch", lambda k, grid, *a, **c: calls.append((k.fn.__name__, grid, a, c)))
    return calls


def _pairs(n, dtype, *, row=True, col=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = hd.Float8Quantizer()
    hps = [torch.randn(SHAPES[i % len(SHAPES)], generator=gen).to(dtype) for i in range(n)]
    dsts = [q.quantize(hp.float(), rowwise=row, columnwise=col) for hp in hps]
    return q, hps, dsts


@pytest.mark.parametrize("dtype, dirs, launches_own, launches_given", [
    (torch.float32, (True, True), 3, 2),  # fp32: the rowwise cast, then a transpose of its codes
    (torch.bfloat16, (True, True), 2, 1),
    (torch.float32, (False, True), 2, 1),
], ids=["fp32-both", "bf16-both", "fp32-col"])
def test_launches_do_not_grow_with_the_parameter_count(launches, dtype, dirs, launches_own, launches_given):
    from hybrid_dist.kernels.fp8.multi import requantize_fp8_many

    for n in (1, 8, 32):
        q, hps, dsts = _pairs(n, dtype, row=dirs[0], col=dirs[1])
        launches.clear()
        assert requantize_fp8_many([q] * n, hps, dsts, None, None) == []
        assert len(launches) == launches_own, f"n={n}: {[c[0] for c in launches]}"
        assert launches[0][1][0] == n, "amax: one program row per tensor"
        for name, grid, args, consts in launches[1:]:  # cast and transpose: one program per tile
            tab = args[0]
            starts = tab[9 * n:10 * n + 1] if name == "_multi_cast_kernel" else tab[10 * n + 1:]
            assert grid == (int(starts[-1]),) and starts[0] == 0 and (starts.diff() > 0).all(), name
            assert consts["LOG_N"] == (n - 1).bit_length() and not consts["ALIGNED"], "SHAPES has K = 130"
        launches.clear()
        amax = torch.ones(n + 1)
        assert requantize_fp8_many([q] * n, hps, dsts, amax, list(range(1, n + 1))) == []
        assert [c[0] for c in launches] == ["_multi_cast_kernel", "_multi_transpose_kernel"][:launches_given], (
            f"n={n} (given amax)")


def test_aligned_entries_are_hinted(launches):
    """Every address, M, K and row stride a multiple of 16: the cast and transpose launches
    say so (``ALIGNED``); one entry off by a row stride of 8 elements: neither does."""
    from hybrid_dist.kernels.fp8.multi import requantize_fp8_many

    q = hd.Float8Quantizer()
    for k, aligned in ((128, True), (136, False)):
        hps = [torch.randn(64, k)[:, :128], torch.randn(32, 256)]
        dsts = [q.quantize(hp) for hp in hps]
        launches.clear()
        assert requantize_fp8_many([q] * 2, hps, dsts, None, None) == []
        assert [(c[0], c[3]["ALIGNED"]) for c in launches[1:]] == [
            ("_multi_cast_kernel", aligned), ("_multi_transpose_kernel", aligned)], f"row stride {k}"


def test_amaxes_one_launch_per_dtype(launches):
    from hybrid_dist.kernels.fp8.multi import amaxes_into

    xs = [torch.randn(s) for s in SHAPES] + [torch.randn(4, 8).bfloat16(), torch.randn(3, 4).t(),
                                             torch.randn(5, dtype=torch.float64)]
    left = amaxes_into(xs, torch.zeros(len(xs)))
    assert left == [len(xs) - 2, len(xs) - 1], "a transposed view and float64 are left to the caller"
    assert sorted(c[3]["X_DTYPE"].name for c in launches) == ["bf16", "fp32"]
    tab = {c[3]["X_DTYPE"].name: c[2][0].reshape(-1, 5) for c in launches}["fp32"]
    assert tab[:, 0].tolist() == [x.data_ptr() for x in xs[:len(SHAPES)]]
    assert tab[:, 4].tolist() == list(range(len(SHAPES))), "output slots"
    assert tab[-1, 1:4].tolist() == [66, 64, 64], "a 3D tensor as [M, K] with its row stride"


def test_tables_are_cached_by_address(launches):
    from hybrid_dist.formats.float8 import Float8Storage
    from hybrid_dist.kernels.fp8.multi import requantize_fp8_many
    from hybrid_dist.quantized_tensor import QuantizedTensor

    q, hps, dsts = _pairs(6, torch.bfloat16, seed=1)
    amax = torch.ones(6)
    requantize_fp8_many([q] * 6, hps, dsts, amax, range(6))
    requantize_fp8_many([q] * 6, hps, dsts, amax, range(6))
    assert launches[0][2][0] is launches[1][2][0], "same buffers: the cached table"
    old = dsts[2]
    row = Float8Storage(data=old.rowwise.data.clone(), scale_inv=old.rowwise.scale_inv.clone(), transposed=False)
    dsts[2] = QuantizedTensor(old.shape, old.dtype, row, old.columnwise, q)  # a reallocated rowwise buffer
    requantize_fp8_many([q] * 6, hps, dsts, amax, range(6))
    tab = launches[2][2][0][:6 * 9].reshape(6, 9)
    assert launches[2][2][0] is not launches[1][2][0]
    assert tab[2, 5].item() == row.data.data_ptr() and tab[2, 7].item() == row.scale_inv.data_ptr()


def test_unserved_pairs_are_left(launches):
    from hybrid_dist.formats.float8 import Float8Storage
    from hybrid_dist.kernels.fp8.multi import requantize_fp8_many
    from hybrid_dist.quantized_tensor import QuantizedTensor

    q, hps, dsts = _pairs(6, torch.float32, seed=2)
    hps[0] = hps[0].t().contiguous().t()  # a column-major master
    hps[2] = hps[2].double()
    st = dsts[3].columnwise
    wrong = Float8Storage(data=st.data.t().contiguous().t(), scale_inv=st.scale_inv, transposed=True)
    dsts[3] = QuantizedTensor(dsts[3].shape, dsts[3].dtype, dsts[3].rowwise, wrong, q)  # non-contiguous buffer
    e5 = hd.Float8Quantizer(dtype=torch.float8_e5m2)  # a buffer of another fp8 dtype than the quantizer's
    assert requantize_fp8_many([q, q, q, q, e5, q], hps, dsts, None, None) == [0, 2, 3, 4]
    assert launches[0][1][0] == 2, "the amax of the two served pairs"
    served = [p.data_ptr() for p in (hps[1], hps[5])]
    for name, _, args, _ in launches[1:]:  # cast (tab, amax, n) and transpose (tab, n)
        assert args[-1] == 2 and args[0][:18].reshape(2, 9)[:, 0].tolist() == served, name


def test_optimizer_hands_all_quantized_parameters_over_at_once(monkeypatch):
    """The write-back's wiring: one call of the batched impl per step with every quantized
    weight (the recording impl leaves them all to ``requantize_``: numbers unchanged)."""
    from hybrid_dist import _kernel_registry

    calls = []

    def record(quantizers, hps, dsts, amax, slots):
        calls.append(len(dsts))
        return list(range(len(dsts)))

    recipe = hd.recipe_from_name("fp8_current")
    with hd.quantized_model_init(recipe):
        model = torch.nn.Sequential(*[hd.Linear(32, 32, recipe=recipe) for _ in range(32)])
    opt = hd.MasterWeightOptimizer(torch.optim.SGD, model.parameters(), lr=0.1)
    monkeypatch.setattr(_kernel_registry, "requantize_many_impl_for",
                        lambda cls, device: record if cls is hd.Float8Quantizer else None)
    for p in model.parameters():
        p.grad = torch.ones(p.shape)
    opt.step()
    assert calls == [32]
    w = model[5].weight
    expect = w.quantizer.quantize(opt.master_of(w))
    for d in ("rowwise", "columnwise"):
        assert torch.equal(w.storage_of(d).data.view(torch.uint8), expect.storage_of(d).data.view(torch.uint8))
