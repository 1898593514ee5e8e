"""The one MAX all-reduce of per-tensor amaxes that every distributed path shares.

``global_amaxes(tensors, groups)`` is what FSDP2 (``hybrid_dist.sharded_params``,
``fsdp2`` quantize-on-gather), the tensor-parallel quantized gather and the expert-parallel
exchange call; ``all_reduce_amaxes`` reduces amaxes already computed (e.g. the Hadamard-
domain amaxes of NVFP4 with RHT next to plain ones).

A per-tensor scale (FP8 ``scale_inv``, NVFP4 ``global_scale``) is valid across shards only
when every shard computed it from the same amax. FSDP2 (masters after the optimizer step,
high-precision shards quantized on the gather), tensor-parallel quantized gathers and the
expert-parallel token exchange all reduce their local amaxes the same way: stack the
fp32 scalars into ``[n]``, one ``all_reduce(MAX)`` per group over the whole vector, read
the entries back. MAX is exact, so the result is the same on every rank and bitwise the
amax of the full tensor.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hybrid_dist.all_reduce import all_reduce
from hybrid_dist.formats import tensor_amaxes


def all_reduce_amaxes(amaxes: Sequence[torch.Tensor] | torch.Tensor, groups: Sequence) -> torch.Tensor:
    """``[n]`` fp32: the MAX of each 0-dim (or 1-element) ``amaxes[i]`` over every group in
    ``groups`` (one collective per group for all ``n`` values; none for no groups). An
    ``[n]`` fp32 tensor may be reduced in place (eagerly): use the result. An empty
    ``amaxes`` returns an empty vector without communicating."""
    if len(amaxes) == 0:
        return torch.zeros(0, dtype=torch.float32)
    if isinstance(amaxes, torch.Tensor):
        buf = amaxes.float().reshape(-1)
    else:
        buf = torch.stack([a.float().reshape(()) for a in amaxes])
    for group in groups:
        _, buf = all_reduce(buf, group, op="max")
    return buf


def global_amaxes(tensors: Sequence[torch.Tensor], groups: Sequence) -> torch.Tensor:
    """``[n]`` fp32: ``max |tensors[i]|`` over every group in ``groups``: each tensor's local
    amax (``tensor_amaxes``), stacked, one MAX all-reduce per group. Index the result
    (``amaxes[i]``) for each tensor's 0-dim global amax."""
    return all_reduce_amaxes(tensor_amaxes(list(tensors)), groups)


__all__ = ["all_reduce_amaxes", "global_amaxes"]
