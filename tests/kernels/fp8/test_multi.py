"""The multi-tensor per-tensor FP8 kernels (``kernels/fp8/multi.py``) and the per-tensor
write-back into a parameter's buffers (``fp8.tensor.quantize_fp8_tensor_into``), under the
Triton interpreter on CPU (marked ``slow``) and on the GPU (marked ``gpu``).

Interpreter: the batched amax is bitwise ``tensor_amax`` of each tensor, and the batched
write-back (``requantize_fp8_many``) writes every byte and ``scale_inv`` that
``fp8.tensor.quantize_fp8_tensor_into`` writes per tensor, also run under the interpreter
(whose fp8 casts round like neither the GPU nor torch, the same on both sides). Mixed
shapes: tiles cut at both edges, one row, a row stride wider than K, 3D, an all-zero tensor;
fp32 and bf16 inputs; rowwise, columnwise and both; own and given amaxes. ``TRITON_INTERPRET=1``
must be set before the kernels are defined, so each check runs in a subprocess.

GPU, the optimizer's write-back path: ``requantize_`` of per-tensor FP8 straight into a
parameter's buffers is bitwise ``quantize`` of the same values (fp32 masters and bf16, both
directions and each alone, with and without a given amax), ``tensor_amaxes`` (one launch per
dtype into one buffer) is bitwise ``tensor_amax`` of each tensor, and the batched write-back
(``requantize_many_``) is bitwise ``requantize_`` of each pair, in a number of kernel launches
that does not grow with the number of parameters.
"""

from __future__ import annotations

import pytest
import torch

import hybrid_dist as hd
from hybrid_dist._tensor_ops import requantize_
from hybrid_dist import hp_init
from hybrid_dist.formats._quantizer import tensor_amax, tensor_amaxes
from hybrid_dist.requantize_many import requantize_many_
from tests._helpers import assert_bitwise_equal, run_under_triton_interpreter
from tests._kernel_helpers import assert_storages_bitwise
from tests._tiers import slow


def _inputs(dtype, gen):
    wide = torch.randn(50, 160, generator=gen)
    xs = [torch.randn(72, 200, generator=gen) * 3, torch.randn(1, 130, generator=gen) * 1e-3,
          torch.randn(65, 129, generator=gen), torch.zeros(40, 64), torch.randn(2, 33, 64, generator=gen) * 50,
          wide[:, :100]]  # row stride 160 > K = 100
    xs[2][7, 5] = -1e4  # the largest magnitude is negative
    return [x.to(dtype) for x in xs]


def _check_amax():
    from hybrid_dist.formats._quantizer import tensor_amax
    from hybrid_dist.kernels.fp8 import multi as fp8_multi

    gen = torch.Generator().manual_seed(0)
    for dtype, cap in ((torch.float32, 1024), (torch.bfloat16, 1024), (torch.float32, 3)):
        fp8_multi._MAX_PROGRAMS = cap  # 3: programs loop over several tiles
        xs = _inputs(dtype, gen)
        out = torch.zeros(len(xs) + 1)
        slots = [len(xs) - i for i in range(len(xs))]  # any slot order
        fp8_multi.multi_amax_into(xs, [fp8_multi.rows_of(x) for x in xs], out, slots)
        for x, s in zip(xs, slots):
            assert_bitwise_equal(out[s], tensor_amax(x), f"amax {dtype} {tuple(x.shape)} slot {s}")
        assert out[0] == 0, "an unused slot was written"
        mixed = xs[:2] + [x.float() for x in xs[2:]] + [torch.randn(8, dtype=torch.float64, generator=gen)]
        out = torch.zeros(len(mixed))
        left = fp8_multi.amaxes_into(mixed, out)  # one launch per dtype; float64 left to the caller
        assert left == [len(mixed) - 1], left
        for i, x in enumerate(mixed[:-1]):
            assert_bitwise_equal(out[i], tensor_amax(x), f"amaxes_into {x.dtype} #{i}")


_ALIGNED_SHAPES = [(64, 128), (16, 48), (160, 32), (2, 32, 64), (48, 256)]


def _quantized_like(q, x, row, col, separate_scale_inv):
    """A destination with the layout ``requantize_`` writes into (garbage values)."""
    from hybrid_dist.formats.float8 import Float8Storage
    from hybrid_dist.quantized_tensor import QuantizedTensor

    t = q.quantize(torch.randn(x.shape) * 7, rowwise=row, columnwise=col)
    if separate_scale_inv and row and col:
        c = t.columnwise
        col_st = Float8Storage(data=c.data, scale_inv=c.scale_inv.clone() + 1, transposed=True)
        t = QuantizedTensor(t.shape, t.dtype, t.rowwise, col_st, q)
    return t


def _storages(t):
    return [None if st is None else (st.data.clone(), st.scale_inv.clone()) for st in (t.rowwise, t.columnwise)]


def _check_cast():
    import hybrid_dist as hd
    from hybrid_dist.kernels.fp8 import multi as fp8_multi, tensor as fp8_tensor

    gen = torch.Generator().manual_seed(1)
    quantizers = (hd.Float8Quantizer(), hd.Float8Quantizer(dtype=torch.float8_e5m2, power_of_2_scales=True,
                                                            amax_epsilon=1e-2))
    for dtype, aligned in ((torch.float32, False), (torch.bfloat16, False), (torch.float32, True),
                           (torch.bfloat16, True)):
        # aligned: every M, K, row stride and address a multiple of 16 (the kernels' ALIGNED hints)
        xs = [torch.randn(s, generator=gen).to(dtype) for s in _ALIGNED_SHAPES] if aligned else _inputs(dtype, gen)
        for q in quantizers:
            for row, col in ((True, True), (True, False), (False, True)):
                for given in (False, True):
                    amax = torch.rand(len(xs) + 2, generator=gen) * 40 if given else None
                    slots = list(range(2, len(xs) + 2))[::-1] if given else None
                    dsts = [_quantized_like(q, x, row, col, i % 2 == 1) for i, x in enumerate(xs)]
                    refs = [_quantized_like(q, x, row, col, i % 2 == 1) for i, x in enumerate(xs)]
                    for i, (x, ref) in enumerate(zip(xs, refs)):
                        a = None if amax is None else amax[slots[i]]
                        r = fp8_tensor.quantize_fp8_tensor_into(q, x.reshape(-1, x.shape[-1]), ref.rowwise,
                                                                ref.columnwise, a)
                        assert r is None, "the per-tensor kernel declined"
                    left = fp8_multi.requantize_fp8_many([q] * len(xs), xs, dsts, amax, slots)
                    assert left == [], left
                    what = (f"{dtype} aligned={aligned} {q.dtype} pow2={q.power_of_2_scales} row={row} col={col} "
                            f"given={given}")
                    for i, (d, ref) in enumerate(zip(dsts, refs)):
                        for name, a, b in zip(("rowwise", "columnwise"), _storages(d), _storages(ref)):
                            assert (a is None) == (b is None)
                            if a is not None:
                                assert_bitwise_equal(a[0], b[0], f"{what} #{i} {name} data")
                                assert_bitwise_equal(a[1], b[1], f"{what} #{i} {name} scale_inv")


def _check_write_back():
    """``requantize_many_`` with the batched FP8 write-back registered (as on CUDA) against
    ``requantize_`` per pair with the per-tensor kernel registered: FP8 pairs (fp32 and bf16
    masters, some keeping a high-precision init) batched, an MXFP8 pair and a master with a
    transposed layout left to ``requantize_``; every byte, scale and init equal."""
    import hybrid_dist as hd
    from hybrid_dist import _kernel_registry as registry
    from hybrid_dist import hp_init
    from hybrid_dist._tensor_ops import requantize_
    from hybrid_dist.formats.float8 import Float8Quantizer
    from hybrid_dist.kernels.fp8 import multi as fp8_multi, tensor as fp8_tensor
    from hybrid_dist.requantize_many import requantize_many_

    served = []

    def many(*args):
        left = fp8_multi.requantize_fp8_many(*args)
        served.append(len(args[1]) - len(left))
        return left

    registry.requantize_many_impl_for = lambda cls, device: many if cls is Float8Quantizer else None
    registry.quantize_into_impl_for = lambda q, x: fp8_tensor.quantize_fp8_tensor_into if type(q) is Float8Quantizer else None
    gen = torch.Generator().manual_seed(2)
    fp8, mx = hd.Float8Quantizer(), hd.MXFP8Quantizer()
    hps = [x * 0.25 for x in _inputs(torch.float32, gen)[:4]] + [torch.randn(64, 32, generator=gen).bfloat16(),
                                                                 torch.randn(64, 96, generator=gen),
                                                                 torch.randn(40, 64, generator=gen).t()]
    qs = [fp8] * 5 + [mx, fp8]
    outs = []
    for run in ("batched", "per pair"):
        dsts = [q.quantize(torch.randn(hp.shape, generator=torch.Generator().manual_seed(i)))
                for i, (q, hp) in enumerate(zip(qs, hps))]
        for i in (0, 3, 6):
            hp_init.keep(dsts[i], torch.zeros(hps[i].shape))
        if run == "batched":
            requantize_many_(dsts, hps)
        else:
            for d, hp in zip(dsts, hps):
                requantize_(d, hp)
        outs.append(dsts)
    assert served == [5], f"pairs served by the batched write-back per call: {served}"
    for i, (a, b) in enumerate(zip(*outs)):
        for d in ("rowwise", "columnwise"):
            for f, t in a.storage_of(d).tensors().items():
                assert_bitwise_equal(t, getattr(b.storage_of(d), f), f"pair #{i} {d}.{f}")
        if i in (0, 3, 6):
            assert_bitwise_equal(hp_init.kept(a), hp_init.kept(b), f"pair #{i} kept init")
            assert_bitwise_equal(hp_init.kept(a), hps[i].float(), f"pair #{i} kept init = master")


CHECKS = ("amax", "cast", "write_back")


@slow  # interpreted kernels and a subprocess start per check
@pytest.mark.parametrize("check", CHECKS)
def test_fp8_multi_under_triton_interpreter(check):
    run_under_triton_interpreter(f"from tests.kernels.fp8.test_multi import _check_{check} as c; c()\n"
                                 f"print('{check} passed')", done=f"{check} passed")


def _every_write_back_case(test):
    """Parametrise ``test`` over the master's dtype, the direction set and an own or a given amax."""
    for mark in (pytest.mark.parametrize("given_amax", [False, True], ids=["own-amax", "given-amax"]),
                 pytest.mark.parametrize("dirs", [(True, True), (True, False), (False, True)],
                                         ids=["both", "row", "col"]),
                 pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])):
        test = mark(test)
    return test


@pytest.mark.gpu
@_every_write_back_case
def test_requantize_into_bitwise_quantize(dtype, dirs, given_amax):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    q = hd.Float8Quantizer()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(384, 256, device="cuda", generator=g).to(dtype)
    row, col = dirs
    dst = q.quantize(torch.randn(384, 256, device="cuda", generator=g).to(dtype), rowwise=row, columnwise=col)
    amax = (x.float().abs().amax() * 1.5) if given_amax else None
    ptrs = [t.data_ptr() for d in ("rowwise", "columnwise") if dst.storage_of(d) is not None
            for t in dst.storage_of(d).tensors().values()]
    requantize_(dst, x, amax=amax)
    ref = q.quantize(x, rowwise=row, columnwise=col, amax=amax)
    for d in ("rowwise", "columnwise"):
        assert_storages_bitwise(dst.storage_of(d), ref.storage_of(d), f"{dtype} {d} (requantize_ into)")
    after = [t.data_ptr() for d in ("rowwise", "columnwise") if dst.storage_of(d) is not None
             for t in dst.storage_of(d).tensors().values()]
    assert after == ptrs, "requantize_ must write into the existing buffers"


@pytest.mark.gpu
def test_tensor_amaxes_bitwise_tensor_amax():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(1)
    xs = [torch.randn(s, device="cuda", generator=g).to(d) * 3
          for s, d in (((512, 256), torch.float32), ((100, 48), torch.bfloat16), ((7,), torch.float32),
                       ((0, 16), torch.float32), ((3, 5, 64), torch.float32))]
    got = tensor_amaxes(xs)
    ref = torch.stack([tensor_amax(x) for x in xs])
    assert torch.equal(got, ref), f"{got.tolist()} != {ref.tolist()}"


_SHAPES = [(384, 256), (1, 130), (65, 129), (128, 64), (3, 5), (40, 64), (2, 33, 64), (1000, 272)]


def _write_back_pairs(n, dtype, dirs, seed):
    q = hd.Float8Quantizer()
    g = torch.Generator(device="cuda").manual_seed(seed)
    hps = [torch.randn(_SHAPES[i % len(_SHAPES)], device="cuda", generator=g).mul(4.0 ** (i % 5 - 2)).to(dtype)
           for i in range(n)]
    hps[3] = torch.zeros_like(hps[3])  # amax 0: scale 1
    hps[5] = torch.randn(40, 100, device="cuda", generator=g).to(dtype)[:, :64]  # row stride 100
    dsts = [q.quantize(torch.randn(hp.shape, device="cuda", generator=g), rowwise=dirs[0], columnwise=dirs[1])
            for hp in hps]
    return hps, dsts


@pytest.mark.gpu
@_every_write_back_case
def test_batched_write_back_bitwise_per_parameter(dtype, dirs, given_amax):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    n = 24
    amax = torch.rand(n + 1, device="cuda") * 30 if given_amax else None
    slots = list(range(1, n + 1))[::-1] if given_amax else None
    outs = []
    for batched in (True, False):
        hps, dsts = _write_back_pairs(n, dtype, dirs, seed=3)
        hp_init.keep(dsts[2], torch.zeros(hps[2].shape))
        if batched:
            requantize_many_(dsts, hps, amax=amax, slots=slots)
        else:
            for i, (d, hp) in enumerate(zip(dsts, hps)):
                requantize_(d, hp, amax=None if amax is None else amax[slots[i]])
        outs.append(dsts)
    for i, (a, b) in enumerate(zip(*outs)):
        for d in ("rowwise", "columnwise"):
            assert_storages_bitwise(a.storage_of(d), b.storage_of(d), f"#{i} {tuple(a.shape)} {dtype} {d}")
    assert torch.equal(hp_init.kept(outs[0][2]), hp_init.kept(outs[1][2])), "kept init"


def _kernels_launched(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, expect", [(torch.float32, 4), (torch.bfloat16, 3)])
def test_batched_write_back_launches_are_constant(dtype, expect):
    """fp32: zero-fill, amax, rowwise cast, transpose of its codes; bf16: one cast for both."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    counts = {}
    for n in (8, 32):
        hps, dsts = _write_back_pairs(n, dtype, (True, True), seed=4)
        requantize_many_(dsts, hps)  # builds the pointer tables
        names = _kernels_launched(lambda: requantize_many_(dsts, hps))
        assert sum("multi" in k for k in names) == expect - 1, names
        counts[n] = len(names)
    assert counts == {8: expect, 32: expect}, counts
