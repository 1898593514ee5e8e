"""The eager host path of ``hd.Linear``: caches that skip repeated work change no result
and hide no error."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import hybrid_dist as hd
from tests._helpers import assert_bitwise_equal


def test_shape_check_cache_hides_no_error():
    q = hd.MXFP8Quantizer()
    q.quantize(torch.randn(64, 64), rowwise=True, columnwise=True)  # cached as valid
    with pytest.raises(ValueError, match="multiple of the 32"):
        q.quantize(torch.randn(48, 64), rowwise=True, columnwise=True)  # columnwise M % 32
    with pytest.raises(ValueError, match="multiple of the 32"):
        q.quantize(torch.randn(64, 48), rowwise=True, columnwise=False)
    with pytest.raises(ValueError, match="floating-point"):
        q.quantize(torch.ones(64, 64, dtype=torch.int32))


def test_shape_check_cache_is_not_config():
    q = hd.Float8Quantizer()
    fresh = hd.Float8Quantizer()
    q.quantize(torch.randn(16, 16))
    assert q == fresh and hash(q) == hash(fresh)
    assert dataclasses.replace(q, margin=1).margin == 1
    assert "_hd_checked_shapes" not in {f.name for f in dataclasses.fields(q)}


@pytest.mark.parametrize("name", ["fp8_current", "mxfp8_fwd_nvfp4_bwd", "fp8_delayed"])
def test_3d_input_equals_2d_input(name):
    """The 2D fast path (no reshapes) and the [B, S, K] path give the same bits."""
    recipe = hd.recipe_from_name(name)
    torch.manual_seed(0)
    a = hd.Linear(64, 32, recipe=recipe, dtype=torch.bfloat16)
    b = hd.Linear(64, 32, recipe=recipe, dtype=torch.bfloat16)
    b.load_state_dict(a.state_dict())
    x = torch.randn(64, 64, dtype=torch.bfloat16)
    dy = torch.randn(64, 32, dtype=torch.bfloat16)
    x2, x3 = x.clone().requires_grad_(True), x.reshape(2, 32, 64).clone().requires_grad_(True)
    y2, y3 = a(x2), b(x3)
    y2.backward(dy)
    y3.backward(dy.reshape(2, 32, 32))
    assert_bitwise_equal(y3.reshape(64, 32), y2, f"{name} y")
    assert_bitwise_equal(x3.grad.reshape(64, 64), x2.grad, f"{name} dx")
    assert_bitwise_equal(b.weight.grad, a.weight.grad, f"{name} dW")
    assert_bitwise_equal(b.bias.grad, a.bias.grad, f"{name} db")
