"""CUDA kernels: Triton quantize kernels, the fused SwiGLU → quantize kernel, the CUDA GEMM
dispatch and the delayed-scaling update, each registered per quantizer class or operand pair.
The kernels of each format live in ``fp8/``, ``mxfp8/`` and ``nvfp4/``; the helpers they
share (``_jit_common``, ``_launch``, ``_zeros``, ``_words``, ``tile_config``, ``transpose``,
``scale_staging``) and the GEMM path (``gemm``, ``dequant``) beside them; ``chunk_copy`` is
FSDP2's gradient copy-in (``fsdp2.grad_copy_in``).

The reference backend (pure torch, ``hybrid_dist.formats``) is the ground truth and runs
everywhere. Importing this package on a machine with CUDA and Triton fills the registry
(``hybrid_dist._kernel_registry``), which the formats and the GEMM consult; on CPU tensors,
or where no kernel is registered, callers use the reference. The registry's functions are
re-exported here.
"""

from __future__ import annotations

import importlib.util

import torch

from hybrid_dist._kernel_registry import (
    amax_into_impl_for,
    amaxes_into_impl_for,
    delayed_advance_impl_for,
    fused_quantize_impl_for,
    gemm_impls_for,
    quantize_impl_for,
    quantize_into_impl_for,
    register_amax_into,
    register_amaxes_into,
    register_delayed_advance,
    register_fused_quantize,
    register_gemm,
    register_quantize,
    register_quantize_into,
    register_requantize_many,
    registered_quantizers,
    requantize_many_impl_for,
)


def _cuda_kernels_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


_AVAILABLE = _cuda_kernels_available()
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None  # importable; without CUDA its interpreter runs
if _AVAILABLE:  # CPU-only installs (CI) never import Triton
    from hybrid_dist.kernels import _register

    _register.register_all()


def kernels_serve(t: torch.Tensor) -> bool:
    """True when this package's Triton kernels may run eagerly on ``t``: CUDA and Triton are
    present, ``t`` is on CUDA, and no graph is being traced."""
    return _AVAILABLE and t.is_cuda and not torch.compiler.is_compiling()


def transposed_2d(t: torch.Tensor) -> torch.Tensor:
    """``t.t().contiguous()`` of a 2D tensor: on CUDA the tiled Triton kernel
    (``kernels.transpose``, bitwise a copy; torch's copy of a transposed 1-byte view runs at
    a small fraction of the copy bandwidth), traced as an operator while compiling;
    elsewhere torch's."""
    if _AVAILABLE and t.is_cuda and t.dim() == 2 and t.element_size() in (1, 2, 4, 8):
        from hybrid_dist.kernels.transpose import transposed

        return transposed(t)
    return t.t().contiguous()

__all__ = ["TRITON_INSTALLED", "amax_into_impl_for", "amaxes_into_impl_for", "delayed_advance_impl_for",
           "fused_quantize_impl_for", "gemm_impls_for", "quantize_impl_for", "quantize_into_impl_for",
           "register_amax_into", "register_amaxes_into", "register_delayed_advance",
           "register_fused_quantize", "register_gemm", "register_quantize", "register_quantize_into",
           "register_requantize_many", "registered_quantizers", "kernels_serve", "requantize_many_impl_for",
           "transposed_2d"]
