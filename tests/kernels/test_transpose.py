"""The tiled transpose kernel moves bytes exactly (every element size, strided sources)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # the kernel module imports Triton (absent on CPU-only installs)

from hybrid_dist.kernels.transpose import transpose_into, transposed  # noqa: E402
from tests._helpers import assert_bitwise_equal  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.uint8, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1), (1, 70), (70, 1), (3, 70), (130, 65), (4096, 3584), (256, 4096)])
def test_transpose_bitwise(dtype, shape):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randint(0, 120, (shape[0], shape[1] * torch.empty((), dtype=dtype).element_size()),
                      dtype=torch.uint8, device="cuda", generator=g).view(dtype)
    assert_bitwise_equal(transposed(x), x.t().contiguous(), f"{dtype} {shape}")
    assert_bitwise_equal(transposed(x.t()), x, f"{dtype} {shape} transposed view")
    out = torch.empty(x.shape[::-1], dtype=dtype, device="cuda")
    assert transpose_into(out, x) is out


def test_transpose_rejects_bad_dst():
    x = torch.zeros(4, 8, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="contiguous dst"):
        transpose_into(torch.empty(4, 8, dtype=torch.uint8, device="cuda"), x)
