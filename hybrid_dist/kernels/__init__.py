"""CUDA kernels: Triton quantize kernels, the fused SwiGLU → quantize kernel, the CUDA GEMM
dispatch and the delayed-scaling update, each registered per quantizer class or operand pair.
The kernels of each format live in ``fp8/``, ``mxfp8/`` and ``nvfp4/``; the helpers they
share (``_jit_common``, ``_launch``, ``_zeros``, ``_words``, ``tile_config``, ``transpose``,
``scale_staging``) and the GEMM path (``gemm``, ``dequant``) beside them.

The reference backend (pure torch, ``hybrid_dist.formats``) is the ground truth and runs
everywhere. Importing this package on a machine with CUDA and Triton fills the registry
(``hybrid_dist._kernel_registry``), which the formats and the GEMM consult; on CPU tensors,
or where no kernel is registered, callers use the reference. The registry's functions are
re-exported here.
"""

from __future__ import annotations

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


if _cuda_kernels_available():  # CPU-only installs (CI) never import Triton
    from hybrid_dist.kernels import _register

    _register.register_all()

__all__ = ["amax_into_impl_for", "amaxes_into_impl_for", "delayed_advance_impl_for", "fused_quantize_impl_for",
           "gemm_impls_for", "quantize_impl_for", "quantize_into_impl_for", "register_amax_into",
           "register_amaxes_into", "register_delayed_advance", "register_fused_quantize", "register_gemm",
           "register_quantize", "register_quantize_into", "register_requantize_many", "registered_quantizers",
           "requantize_many_impl_for"]
