"""``HighPrecisionParam``: a high-precision parameter that FSDP2 all-gathers quantized.

A thin wrapper subclass around an fp32/bf16 tensor ``_data`` plus the quantizer its Linear
uses for weights. Every op runs on ``_data`` (the optimizer steps it in place); the ops
FSDP2 uses to shard and pad (split/chunk, slice/narrow, new_zeros, copy_, view, detach,
clone, device moves) keep the wrapper so the shard still carries the FSDP2 hooks. The
hooks (``_hp_gather``) quantize the shard per direction on all-gather, or gather
high precision and quantize the full tensor when a shard does not align with the blocks.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves, tree_map_only

from hybrid_dist.fsdp2._hp_gather import hp_post_all_gather, hp_pre_all_gather
from hybrid_dist.presigned import presigned

aten = torch.ops.aten

# ops whose tensor outputs stay HighPrecisionParam (FSDP2 sharding, padding, moves)
_PRESERVE = {
    aten.detach.default, aten.alias.default, aten.view.default, aten._unsafe_view.default,
    aten.as_strided.default, aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default,
    aten.narrow.default, aten.new_zeros.default, aten.new_empty.default, aten.empty_like.default,
    aten.zeros_like.default, aten.clone.default, aten._pin_memory.default,
}


class HighPrecisionParam(torch.Tensor):
    """``HighPrecisionParam(data, quantizer)``: ``data``'s shape, dtype and values."""

    _data: torch.Tensor  # the high-precision values (what the optimizer updates)
    _quantizer: object  # the weight quantizer applied on all-gather

    @staticmethod
    def __new__(cls, data: torch.Tensor, quantizer, *, requires_grad: bool = False):
        self = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=data.dtype, device=data.device, requires_grad=requires_grad,
        )
        self._data = data
        self._quantizer = quantizer
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def quantizer(self):
        return self._quantizer

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"HighPrecisionParam({self._data!r}, quantizer={self._quantizer})"

    def __tensor_flatten__(self):
        return ["_data"], (self._quantizer,)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        return HighPrecisionParam(inner_tensors["_data"], ctx[0])

    def __reduce_ex__(self, protocol):
        return (HighPrecisionParam, (self._data, self._quantizer))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = next(a for a in _flat(args, kwargs) if isinstance(a, HighPrecisionParam))
        unwrap = lambda t: t._data  # noqa: E731
        out = func(*tree_map_only(cls, unwrap, args), **tree_map_only(cls, unwrap, kwargs))
        if func in _PRESERVE or (func is aten._to_copy.default and out.dtype == first.dtype):
            return tree_map_only(torch.Tensor, lambda t: cls(t, first._quantizer), out)
        if func._schema.is_mutable and isinstance(args[0], HighPrecisionParam):
            return args[0]  # in-place on the wrapper (copy_, the optimizer's ops)
        return out

    # --- FSDP2 all-gather extension ------------------------------------------------
    @presigned  # FSDP2 inspects its signature at every unshard
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return hp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        return hp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, out=out)


def _flat(args, kwargs):
    return tree_leaves((args, kwargs))
