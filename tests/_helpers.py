"""Assertion helpers shared by the CPU tests."""

from __future__ import annotations

import torch


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (inf when equal)."""
    ref, approx = ref.detach().double(), approx.detach().double()
    noise = (ref - approx).pow(2).mean()
    if noise == 0:
        return float("inf")
    return float(10 * torch.log10(ref.pow(2).mean() / noise))


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of ``t`` (so NaNs and fp8 compare bitwise)."""
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous().view(
        {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    ba, bb = as_bits(a), as_bits(b)
    if not torch.equal(ba, bb):
        n = int((ba != bb).sum())
        raise AssertionError(f"{what}: {n} of {ba.numel()} elements differ bitwise")


def assert_storage_equal(a, b, what: str = "") -> None:
    """Two direction storages (or both None) are bitwise equal, field by field."""
    assert (a is None) == (b is None), f"{what}: one direction missing"
    if a is None:
        return
    assert type(a) is type(b) and a.transposed == b.transposed, what
    for f in a.TENSOR_FIELDS:
        assert_bitwise_equal(getattr(a, f), getattr(b, f), f"{what}.{f}")
