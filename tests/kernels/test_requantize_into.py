"""The optimizer's write-back path on CUDA: ``requantize_`` of per-tensor FP8 straight into
a parameter's buffers is bitwise ``quantize`` of the same values (fp32 masters and bf16,
both directions and each alone, with and without a given amax), ``tensor_amaxes`` (one
launch per dtype into one buffer) is bitwise ``tensor_amax`` of each tensor, and the batched
write-back (``requantize_many_``) is bitwise ``requantize_`` of each pair, in a number of
kernel launches that does not grow with the number of parameters."""

from __future__ import annotations

import pytest
import torch

import hybrid_dist as hd
from hybrid_dist._tensor_ops import requantize_
from hybrid_dist import hp_init
from hybrid_dist.formats._quantizer import tensor_amax, tensor_amaxes
from hybrid_dist.requantize_many import requantize_many_
from tests._kernel_helpers import assert_storages_bitwise

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dirs", [(True, True), (True, False), (False, True)], ids=["both", "row", "col"])
@pytest.mark.parametrize("given_amax", [False, True], ids=["own-amax", "given-amax"])
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dirs", [(True, True), (True, False), (False, True)], ids=["both", "row", "col"])
@pytest.mark.parametrize("given_amax", [False, True], ids=["own-amax", "given-amax"])
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


@pytest.mark.parametrize("dtype, expect", [(torch.float32, 4), (torch.bfloat16, 3)])
def test_batched_write_back_launches_are_constant(dtype, expect):
    """fp32: zero-fill, amax, rowwise cast, columnwise cast; bf16: one cast for both."""
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
