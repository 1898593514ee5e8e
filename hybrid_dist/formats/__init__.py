"""Formats: one file each, with its quantizer, storage, reference quantize/dequantize and
layout docstring."""

from hybrid_dist.formats._quantizer import Quantizer, tensor_amax, tensor_amaxes
from hybrid_dist.formats._storage import DirectionStorage, storage_meta_fields
from hybrid_dist.formats.float8 import DelayedScalingState, Float8Quantizer, Float8Storage
from hybrid_dist.formats.float8_block import Float8BlockQuantizer, Float8BlockStorage
from hybrid_dist.formats.identity import IdentityQuantizer, IdentityStorage
from hybrid_dist.formats.mxfp8 import MXFP8Quantizer, MXFP8Storage
from hybrid_dist.formats.nvfp4 import NVFP4Quantizer, NVFP4State, NVFP4Storage

__all__ = [
    "DelayedScalingState", "DirectionStorage", "Float8BlockQuantizer", "Float8BlockStorage",
    "Float8Quantizer", "Float8Storage", "IdentityQuantizer", "IdentityStorage",
    "MXFP8Quantizer", "MXFP8Storage", "NVFP4Quantizer", "NVFP4State", "NVFP4Storage", "Quantizer",
    "storage_meta_fields", "tensor_amax", "tensor_amaxes",
]
