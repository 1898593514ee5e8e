"""The optimizer's write-back path on CUDA: ``requantize_`` of per-tensor FP8 straight into
a parameter's buffers is bitwise ``quantize`` of the same values (fp32 masters and bf16,
both directions and each alone, with and without a given amax), and ``tensor_amaxes``
(the amax kernel into one buffer) is bitwise ``tensor_amax`` of each tensor."""

from __future__ import annotations

import pytest
import torch

import hybrid_dist as hd
from hybrid_dist._tensor_ops import requantize_
from hybrid_dist.formats._quantizer import tensor_amax, tensor_amaxes
from tests.gpu._gpu_helpers import assert_storages_bitwise

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
