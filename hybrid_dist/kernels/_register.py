"""Registers the Triton quantize kernels (one tensor, or many per launch), the fused SwiGLU →
quantize kernel, the CUDA GEMM, the MXFP8 dequantize and the delayed-scaling update with the registry
(``hybrid_dist._kernel_registry``).

Imported by ``hybrid_dist.kernels`` only when CUDA and Triton are both available.
"""

from __future__ import annotations

from hybrid_dist import _kernel_registry as registry
from hybrid_dist.formats.float8 import Float8Quantizer
from hybrid_dist.formats.float8_block import Float8BlockQuantizer
from hybrid_dist.formats.mxfp8 import MXFP8Quantizer, MXFP8Storage
from hybrid_dist.formats.nvfp4 import NVFP4Quantizer


def register_all() -> None:
    from hybrid_dist.kernels.fp8.block import quantize_fp8_block
    from hybrid_dist.kernels.fp8.delayed import advance_
    from hybrid_dist.kernels.fp8.multi import amaxes_into, requantize_fp8_many
    from hybrid_dist.kernels.fp8.tensor import _amax_2d, quantize_fp8_tensor, quantize_fp8_tensor_into
    from hybrid_dist.kernels.gemm import bf16_operand, gemm_nt_cuda
    from hybrid_dist.kernels.mxfp8.quantize import quantize_mxfp8
    from hybrid_dist.kernels.fp8.swiglu import swiglu_quantize_fp8
    from hybrid_dist.kernels.nvfp4.quantize import columnwise_rht_amax_nvfp4, quantize_nvfp4

    registry.register_quantize(Float8Quantizer, quantize_fp8_tensor)
    registry.register_quantize(Float8BlockQuantizer, quantize_fp8_block)
    registry.register_quantize_into(Float8Quantizer, quantize_fp8_tensor_into)
    registry.register_amax_into(_amax_2d)
    registry.register_amaxes_into(amaxes_into)
    registry.register_requantize_many(Float8Quantizer, requantize_fp8_many)
    registry.register_quantize(MXFP8Quantizer, quantize_mxfp8)
    registry.register_quantize(NVFP4Quantizer, quantize_nvfp4)
    registry.register_rht_amax(columnwise_rht_amax_nvfp4)
    registry.register_fused_quantize("swiglu", Float8Quantizer, swiglu_quantize_fp8)
    registry.register_gemm(gemm_nt_cuda)
    registry.register_dequantize_bf16(MXFP8Storage, bf16_operand)
    registry.register_delayed_advance(advance_)
