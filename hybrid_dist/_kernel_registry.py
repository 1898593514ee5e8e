"""The kernel registry: which CUDA kernel (if any) serves a format, a fused producer, a
GEMM or a delayed-scaling update on a device.

The bottom of the core: it imports nothing of hybrid_dist. The formats and the GEMM consult
it; ``hybrid_dist.kernels`` fills it when imported on a machine with CUDA and Triton
(``hybrid_dist/__init__`` imports the kernels after the formats). On CPU tensors, or where
nothing is registered, callers run the pure-torch reference.
"""

from __future__ import annotations

from typing import Callable

import torch

_QUANTIZE: dict[type, Callable] = {}
_QUANTIZE_INTO: dict[type, Callable] = {}
_AMAX_INTO: list[Callable] = []  # at most one: impl(x2d, out_scalar)
_AMAXES_INTO: list[Callable] = []  # at most one: impl(xs, out) -> indices left undone
_REQUANTIZE_MANY: dict[type, Callable] = {}
_FUSED: dict[tuple[str, type], Callable] = {}  # (producer op, quantizer class) -> impl
_GEMM: list[Callable] = []
_DELAYED_ADVANCE: list[Callable] = []  # at most one: impl(history, scale, quantizer)
_RHT_AMAX: list[Callable] = []  # at most one: impl(quantizer, x2d) -> fp32 []
_DEQUANTIZE_BF16: dict[type, Callable] = {}  # storage class -> impl(storage) -> bf16 [R, C]


def register_quantize(quantizer_cls: type, impl: Callable) -> None:
    """``impl(quantizer, x2d, *, rowwise, columnwise, state, amax) -> (row, col)`` or
    ``NotImplemented`` to defer to the reference for that call. An NVFP4 impl also takes
    ``rht_amax`` (the Hadamard direction's amax, see ``register_rht_amax``)."""
    _QUANTIZE[quantizer_cls] = impl


def register_quantize_into(quantizer_cls: type, impl: Callable) -> None:
    """``impl(quantizer, x2d, row_storage, col_storage, amax)`` writes the quantization of
    ``x2d`` into existing storages (either may be None) bitwise as quantize-then-copy, or
    returns ``NotImplemented`` (the caller quantizes and copies)."""
    _QUANTIZE_INTO[quantizer_cls] = impl


def register_amax_into(impl: Callable) -> None:
    """``impl(x2d, out)``: max-reduce ``max|x2d|`` (fp32) into the zeroed scalar ``out``."""
    _AMAX_INTO[:] = [impl]


def register_amaxes_into(impl: Callable) -> None:
    """``impl(xs, out) -> list[int]``: max-reduce ``max|xs[i]|`` (fp32) into the zeroed
    ``out[i]`` for every ``i`` it serves, in a constant number of launches; returns the
    indices it left (the caller reduces those one by one)."""
    _AMAXES_INTO[:] = [impl]


def register_requantize_many(quantizer_cls: type, impl: Callable) -> None:
    """``impl(quantizers, hps, dsts, amax, slots) -> list[int]``: write the quantization of
    ``hps[i]`` (current scaling: delayed becomes current, as ``hybrid.stateless``) into the
    storages of QuantizedTensor ``dsts[i]`` for every ``i`` it serves, bitwise
    ``requantize_``, in a constant number of launches; the amax is ``amax[slots[i]]``, or
    ``max|hps[i]|`` when ``amax`` is None. Returns the indices it left."""
    _REQUANTIZE_MANY[quantizer_cls] = impl


def register_fused_quantize(op: str, quantizer_cls: type, impl: Callable) -> None:
    """A kernel computing a producer's output (``op``: ``"swiglu"``) and
    quantizing it in one go, never writing the high-precision output (``hd.SwiGLU``;
    see ``hybrid_dist.shared_input``). ``impl(quantizer, *inputs2d, *,
    rowwise, columnwise) -> (row, col)`` or ``NotImplemented`` to defer to the reference."""
    _FUSED[(op, quantizer_cls)] = impl


def register_gemm(impl: Callable) -> None:
    """``impl(a, b, *, out_dtype, config) -> Tensor`` or ``NotImplemented`` (registered once)."""
    if impl not in _GEMM:
        _GEMM.append(impl)


def register_rht_amax(impl: Callable) -> None:
    """``impl(nvfp4_quantizer, x2d) -> fp32 []``: the amax of ``x2d``'s columnwise direction
    in its Hadamard domain, bitwise the value the NVFP4 quantize impl derives itself (so a
    MAX over row shards reproduces the full tensor's quantization)."""
    _RHT_AMAX[:] = [impl]


def register_dequantize_bf16(storage_cls: type, impl: Callable) -> None:
    """``impl(storage) -> bf16 [R, C]``: the stored matrix with its block scales applied,
    bitwise ``storage.values().to(torch.bfloat16)``; only for storages whose values are
    exact in bf16 and that have no per-tensor scale (MXFP8)."""
    _DEQUANTIZE_BF16[storage_cls] = impl


def register_delayed_advance(impl: Callable) -> None:
    """``impl(history, scale, quantizer)``: ``DelayedScalingState.advance`` in place for a
    history ``[L]`` and scale ``[]``, or a stack ``[E, L]`` and ``[E]``."""
    _DELAYED_ADVANCE[:] = [impl]


def quantize_impl_for(quantizer, x: torch.Tensor):
    if x.device.type != "cuda":
        return None
    return _QUANTIZE.get(type(quantizer))


def quantize_into_impl_for(quantizer, x: torch.Tensor):
    if x.device.type != "cuda":
        return None
    return _QUANTIZE_INTO.get(type(quantizer))


def amax_into_impl_for(x: torch.Tensor):
    if x.device.type != "cuda" or not _AMAX_INTO:
        return None
    return _AMAX_INTO[0]


def amaxes_into_impl_for(x: torch.Tensor):
    if x.device.type != "cuda" or not _AMAXES_INTO:
        return None
    return _AMAXES_INTO[0]


def requantize_many_impl_for(quantizer_cls: type, device: torch.device):
    if device.type != "cuda":
        return None
    return _REQUANTIZE_MANY.get(quantizer_cls)


def fused_quantize_impl_for(op: str, quantizer, x: torch.Tensor):
    if x.device.type != "cuda":
        return None
    return _FUSED.get((op, type(quantizer)))


def gemm_impls_for(a_device: torch.device) -> list[Callable]:
    return _GEMM if a_device.type == "cuda" else []


def dequantize_bf16_impl_for(storage, device: torch.device):
    if device.type != "cuda":
        return None
    return _DEQUANTIZE_BF16.get(type(storage))


def delayed_advance_impl_for(history: torch.Tensor):
    if history.device.type != "cuda" or not _DELAYED_ADVANCE:
        return None
    return _DELAYED_ADVANCE[0]


def rht_amax_impl_for(x: torch.Tensor):
    if x.device.type != "cuda" or not _RHT_AMAX:
        return None
    return _RHT_AMAX[0]


def registered_quantizers() -> tuple[type, ...]:
    """Quantizer classes with a registered CUDA kernel (empty without CUDA + Triton)."""
    return tuple(_QUANTIZE)


__all__ = ["amax_into_impl_for", "amaxes_into_impl_for", "delayed_advance_impl_for", "fused_quantize_impl_for",
           "gemm_impls_for", "quantize_impl_for", "quantize_into_impl_for", "register_amax_into",
           "register_amaxes_into", "register_delayed_advance", "register_fused_quantize", "register_gemm",
           "register_quantize", "register_quantize_into", "register_requantize_many", "register_rht_amax",
           "registered_quantizers", "requantize_many_impl_for", "rht_amax_impl_for"]
