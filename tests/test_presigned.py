"""``presigned``: the bound form answers ``inspect.signature`` with one prebuilt signature
(FSDP2 asks at every unshard) and calls the function with the instance first."""

from __future__ import annotations

import inspect

import torch

import hybrid_dist as hd
from hybrid_dist.fsdp2 import HighPrecisionParam
from hybrid_dist.presigned import presigned


class _Thing:
    def __init__(self, base: int):
        self.base = base

    @presigned
    def add(self, a, b=2, *, c=3):
        return self.base + a + b + c


def test_bound_call_and_signature():
    x, y = _Thing(10), _Thing(20)
    assert x.add(1) == 16 and y.add(1, 0, c=0) == 21
    sig = inspect.signature(x.add)
    assert str(sig) == "(a, b=2, *, c=3)"
    assert sig is inspect.signature(y.add)  # built once, not per call
    assert _Thing.add.__name__ == "add" and str(inspect.signature(_Thing.add)) == "(self, a, b=2, *, c=3)"


def test_fsdp_pre_all_gather_signature_is_prebuilt():
    """FSDP2 accepts 5 parameters (mesh, outer_size, outer_stride, module, mp_policy)."""
    qt = hd.Float8Quantizer().quantize(torch.randn(32, 32))
    hp = HighPrecisionParam(torch.randn(32, 32), hd.Float8Quantizer())
    for t in (qt, hp):
        sig = inspect.signature(t.fsdp_pre_all_gather)
        assert list(sig.parameters) == ["mesh", "outer_size", "outer_stride", "module", "mp_policy"]
        assert sig is inspect.signature(t.fsdp_pre_all_gather)
