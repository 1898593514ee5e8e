"""hybrid_dist: hybrid (per-direction) low-precision training for PyTorch.

See docs/design.md §3 for the public API; everything not in ``__all__`` is private.
"""

import torch as _torch

from hybrid_dist import _tensor_ops  # noqa: F401  (fills the QuantizedTensor op table)
from hybrid_dist.activation import SwiGLU
from hybrid_dist.autocast import autocast, quantized_model_init
from hybrid_dist.convert import convert_to_hybrid, set_recipe
from hybrid_dist.formats import (
    DelayedScalingState,
    Float8BlockQuantizer,
    Float8Quantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    Quantizer,
)
from hybrid_dist.formats import _quantizer as _quantizer_mod
from hybrid_dist.formats import _storage as _storage_mod
from hybrid_dist.formats import float8 as _f8, float8_block as _f8b, identity as _id, mxfp8 as _mx, nvfp4 as _nv
from hybrid_dist.gemm import GemmConfig
from hybrid_dist.hybrid import HybridQuantizer
from hybrid_dist.kernels.dedupe_launches import compile_options
from hybrid_dist.linear import Linear
from hybrid_dist.norm import RMSNorm
from hybrid_dist.optim import MasterWeightOptimizer
from hybrid_dist.quantized_tensor import QuantizedTensor, _rebuild_quantized_tensor
from hybrid_dist.recipes import RECIPE_NAMES, CustomRecipe, Recipe, Role, recipe_from_name
from hybrid_dist.shared_input import link_quantized_input

# The kernels fill the registry that the formats consult (CUDA + Triton only); importing
# them here, in eager code, means no trace ever meets an unfilled registry.
from hybrid_dist import kernels as _kernels  # noqa: E402,F401

# torch.load(weights_only=True) may rebuild our tensors and configs (allowlist, additive).
_torch.serialization.add_safe_globals([
    _rebuild_quantized_tensor, QuantizedTensor, HybridQuantizer,
    _f8.Float8Quantizer, _f8.Float8Storage, _f8b.Float8BlockQuantizer, _f8b.Float8BlockStorage,
    _mx.MXFP8Quantizer, _mx.MXFP8Storage, _nv.NVFP4Quantizer, _nv.NVFP4Storage,
    _id.IdentityQuantizer, _id.IdentityStorage,
])
del _storage_mod, _quantizer_mod

# Last, once the core is complete: hybrid_dist.fsdp2 registers QuantizedTensor's FSDP2
# all-gather hooks, so fully_shard works on quantized parameters without importing it.
if _torch.distributed.is_available():
    from hybrid_dist import fsdp2 as _fsdp2  # noqa: E402,F401

__all__ = [
    "CustomRecipe", "DelayedScalingState", "Float8BlockQuantizer", "Float8Quantizer", "GemmConfig",
    "HybridQuantizer", "IdentityQuantizer", "Linear", "MXFP8Quantizer", "MasterWeightOptimizer",
    "NVFP4Quantizer", "QuantizedTensor", "Quantizer", "RECIPE_NAMES", "RMSNorm", "Recipe", "Role", "SwiGLU",
    "autocast", "compile_options", "convert_to_hybrid", "link_quantized_input", "quantized_model_init",
    "recipe_from_name", "set_recipe",
]
