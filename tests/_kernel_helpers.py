"""Helpers of the tests that hold the CUDA kernels to the reference: raw bits, bitwise
comparison of storages, one quantize through the registered kernel or the reference."""

from __future__ import annotations

import torch

from hybrid_dist import kernels


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bits of ``t`` as a flat integer tensor (any strides)."""
    flat = t.reshape(-1).contiguous()
    return flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def n_bit_diffs(a: torch.Tensor, b: torch.Tensor, what: str) -> int:
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    return int((bits(a) != bits(b)).sum())


def assert_storages_bitwise(kernel_st, ref_st, what: str, skip=()) -> None:
    assert (kernel_st is None) == (ref_st is None), f"{what}: one direction missing"
    if ref_st is None:
        return
    assert type(kernel_st) is type(ref_st) and kernel_st.same_meta(ref_st), f"{what}: metadata differs"
    for f in ref_st.TENSOR_FIELDS:
        if f in skip:
            continue
        n = n_bit_diffs(getattr(kernel_st, f), getattr(ref_st, f), f"{what}.{f}")
        assert n == 0, f"{what}.{f}: {n} of {getattr(ref_st, f).numel()} elements differ bitwise"


def kernel_quantize(q, x, **kw):
    """The registered CUDA kernel's (row, col) storages for ``x`` (asserts one is registered)."""
    impl = kernels.quantize_impl_for(q, x)
    assert impl is not None, f"no CUDA kernel registered for {type(q).__name__}"
    out = impl(q, x, state=kw.pop("state", None), amax=kw.pop("amax", None), **kw)
    assert out is not NotImplemented
    return out


def reference_quantize(q, x, **kw):
    return q._quantize_2d(x, state=kw.pop("state", None), amax=kw.pop("amax", None), **kw)
