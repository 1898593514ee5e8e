"""Quantize-on-all-gather for high-precision parameters (opt-in), and the fallback for
shards that do not align with a format's blocks.

``quantize_on_all_gather(model, recipe=..., shard_world_size=...)`` wraps every
high-precision ``hd.Linear`` weight as a :class:`HighPrecisionParam`, and every quantized
weight (``hd.quantized_model_init``) whose shards would not align — those cannot be split
in the quantized domain — from its high-precision init (or its dequantization). Under
``fully_shard``, aligned shards are quantized per direction before the gather, unaligned ones gathered in
high precision and quantized after (``_hp_gather``); an unaligned shard is warned about
once, here, at wrap time (parameter, shard rows, block).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from hybrid_dist.fsdp2._hp_gather import block_rows, is_aligned, shard_rows
from hybrid_dist import hp_init
from hybrid_dist.fsdp2._hp_param import HighPrecisionParam
from hybrid_dist.linear import Linear
from hybrid_dist.quantized_tensor import QuantizedTensor


def quantize_on_all_gather(model: nn.Module, *, recipe=None, shard_world_size: int) -> nn.Module:
    """Wrap ``hd.Linear`` weights as :class:`HighPrecisionParam` (in place; call before
    ``fully_shard``): every high-precision weight, and quantized weights with unaligned
    shards. ``recipe``: the weights' recipe (default: each module's own);
    ``shard_world_size``: ranks of the FSDP shard group, to check block alignment."""
    if shard_world_size < 1:
        raise ValueError(f"quantize_on_all_gather: shard_world_size must be >= 1, got {shard_world_size}")
    for fqn, mod in model.named_modules():
        if not isinstance(mod, Linear):
            continue
        w = mod.weight
        if isinstance(w, QuantizedTensor):
            q = w.quantizer
            hp = hp_init.kept(w)
            data = (hp if hp is not None else w.dequantize(dtype=torch.float32)).to(w.dtype)
        else:
            r = recipe or mod.recipe
            if r is None:
                raise ValueError(f"quantize_on_all_gather: {fqn} has no recipe; pass recipe=...")
            q, data = mod.plan_for(r).weight, w.detach()
        name = f"{fqn}.weight" if fqn else "weight"
        aligned = is_aligned(q, tuple(data.shape), shard_world_size)
        if isinstance(w, QuantizedTensor) and aligned:
            continue  # quantized parameters shard and gather as they are (``_hooks``)
        if not aligned:
            warnings.warn(
                f"hybrid_dist.fsdp2: parameter {name} of shape {tuple(data.shape)} sharded over "
                f"{shard_world_size} ranks gives shards of {shard_rows(data.shape, shard_world_size)} rows, "
                f"not a multiple of the {block_rows(q, data.shape)}-row block of {type(q).__name__}: "
                "it is all-gathered in high precision and quantized after the gather (exact, "
                "but moves more bytes).", stacklevel=2,
            )
        mod.weight = nn.Parameter(HighPrecisionParam(data.contiguous(), q), requires_grad=w.requires_grad)
    return model
