"""``kernels.fp8.block`` (1×128 and 128×128 blocks) on the GPU: bitwise the reference.
"""

from __future__ import annotations

import pytest

import hybrid_dist as hd
from tests.kernels._quantize_checks import DIRS, SHAPES, check_bitwise, make_x

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("block", ["1x128", "128x128"])
def test_fp8_block_bitwise(shape, block):
    for pow2, eps in ((True, 0.0), (False, 0.0), (True, 1e-4)):
        q = hd.Float8BlockQuantizer(block=block, power_of_2_scales=pow2, amax_epsilon=eps)
        x = make_x(shape)
        x[:128, :128] = 0.0  # an all-zero block (scale 1)
        for rw, cw in DIRS:
            check_bitwise(q, x, rw, cw, f"fp8_block {block} pow2={pow2} eps={eps} {shape} dirs={rw, cw}")


def test_fp8_block_1x128_rowwise_partial_tiles():
    """1x128 rowwise is the one FP8 block case where M need not be a multiple of 128: the
    kernel's last row of tiles is partial (masked), bitwise the reference."""
    for pow2 in (True, False):
        q = hd.Float8BlockQuantizer(block="1x128", power_of_2_scales=pow2)
        check_bitwise(q, make_x((200, 384)), True, False, f"fp8_block 1x128 rowwise (200, 384) pow2={pow2}")
