"""The high-precision init a quantized parameter keeps for its fp32 master.

A weight quantized at creation (``hd.quantized_model_init``) or at conversion
(``hd.convert_to_hybrid(..., quantized_weights=True)``) may keep the fp32 values it was
quantized from, so that ``MasterWeightOptimizer`` starts its master from them rather than
from the dequantized weight. The values ride on the :class:`QuantizedTensor` itself, as a
plain fp32 tensor of its logical shape, and every op of the tensor's op table that makes a
tensor from another (``detach``, ``view``, ``narrow`` / ``split``, ``new_zeros``,
``copy_``, ``clone``, device moves, ``cat``) applies the same operation to them.

[Note: the init through fully_shard]
FSDP2 shards a parameter with ``split`` (its rank's rows), ``new_zeros`` (a padded shard),
``narrow(...).copy_(rows)`` and ``narrow`` again; the init follows each step, so the local
shard of the sharded parameter carries exactly its rows of the init, and the sharded
master is bitwise the matching rows of the unsharded master. Views share the init's
storage as they share the quantized storages; ``take`` copies the rows out and frees that
storage for every view at once (``untyped_storage().resize_(0)``), so no copy is left
behind in FSDP2's flat alias of the shard. The invariant: when present, the init is the
high-precision tensor whose quantization is the stored data. ``copy_`` of high-precision
values (and ``requantize_``) writes them into it; ``copy_`` of another quantized tensor
writes that tensor's init, or its dequantization where it has none.
"""

from __future__ import annotations

import torch

_ATTR = "_hd_hp_init"  # plain attribute of the QuantizedTensor (not flattened, not pickled)


def kept(t: torch.Tensor) -> torch.Tensor | None:
    """The fp32 init ``t`` keeps (a QuantizedTensor, or a DTensor of one: its local rows),
    or None: never kept, or already taken."""
    local = getattr(t, "_local_tensor", t)
    hp = local.__dict__.get(_ATTR)
    if hp is None or hp.untyped_storage().size() == 0:
        return None
    return hp


def keep(t: torch.Tensor, hp: torch.Tensor, *, copy: bool = True) -> None:
    """Keep ``hp`` (``t``'s shape) as the init of QuantizedTensor ``t``, in fp32 on ``t``'s
    device; ``copy=False`` takes ``hp`` itself when it is already that (the caller gives
    up the tensor: ``take`` frees its storage) and is not ``t``'s own data (an identity
    direction may hold the very tensor it was made from)."""
    if tuple(hp.shape) != tuple(t.shape):
        raise ValueError(f"keep: init of shape {tuple(hp.shape)} for a tensor of shape {tuple(t.shape)}")
    copy = copy or _shares_storage(t, hp)
    hp = hp.detach().to(device=t.device, dtype=torch.float32, copy=copy).contiguous()
    t.__dict__[_ATTR] = hp


def _shares_storage(t: torch.Tensor, hp: torch.Tensor) -> bool:
    ptr = hp.untyped_storage().data_ptr()
    return any(x.untyped_storage().data_ptr() == ptr
               for d in ("rowwise", "columnwise") if t.storage_of(d) is not None
               for x in t.storage_of(d).tensors().values())


def take(t: torch.Tensor) -> torch.Tensor | None:
    """A contiguous fp32 copy of ``t``'s init (its local rows for a DTensor), which is then
    freed for ``t`` and every view of it; None if it keeps none."""
    hp = kept(t)
    if hp is None:
        return None
    out = hp.clone()
    hp.untyped_storage().resize_(0)
    getattr(t, "_local_tensor", t).__dict__.pop(_ATTR, None)
    return out


def follow(new: torch.Tensor, old: torch.Tensor, fn) -> torch.Tensor:
    """Give ``new`` the init ``fn(init of old)`` if ``old`` keeps one; returns ``new``."""
    hp = kept(old)
    if hp is not None:
        new.__dict__[_ATTR] = fn(hp)
    return new


@torch.no_grad()
def write(t: torch.Tensor, values: torch.Tensor) -> None:
    """``t``'s data now quantizes ``values``: copy them into its init, if it keeps one."""
    hp = kept(t)
    if hp is not None:
        hp.copy_(values.detach().reshape(hp.shape))


__all__ = ["follow", "keep", "kept", "take", "write"]
