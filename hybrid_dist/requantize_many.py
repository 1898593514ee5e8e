"""``requantize_many_``: ``requantize_`` of many (quantized tensor, high-precision values)
pairs, in a constant number of launches where a batched kernel serves them.

Pairs whose quantizer class has a batched write-back on their device
(``_kernel_registry.requantize_many_impl_for``: per-tensor FP8 on CUDA) go to it, which
takes the groups it can write straight into the existing buffers (one amax launch and one
or two cast launches per group); every other pair, and every pair while compiling, goes
through ``requantize_`` one by one. Either way each tensor ends bitwise as ``requantize_``
leaves it, its kept high-precision init (``hp_init``) included.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hybrid_dist import _kernel_registry, hp_init
from hybrid_dist._tensor_ops import requantize_
from hybrid_dist.quantized_tensor import QuantizedTensor


@torch.no_grad()
def requantize_many_(dsts: Sequence[QuantizedTensor], hps: Sequence[torch.Tensor], *,
                     amax: torch.Tensor | None = None, slots: Sequence[int] | None = None) -> None:
    """``requantize_(dsts[i], hps[i], amax=amax[slots[i]])`` for every ``i`` (``amax=None``:
    each tensor's own amax; ``slots`` defaults to ``range(len(dsts))``)."""
    if amax is not None and slots is None:
        slots = range(len(dsts))
    left = _batched(dsts, hps, amax, slots) if dsts and not torch.compiler.is_compiling() else range(len(dsts))
    for i in left:
        requantize_(dsts[i], hps[i], amax=None if amax is None else amax[slots[i]])


def _batched(dsts, hps, amax, slots) -> list[int]:
    """Hand each quantizer class's pairs to its batched write-back; the indices left."""
    by_cls: dict[type, list[int]] = {}
    for i, d in enumerate(dsts):
        by_cls.setdefault(type(d.quantizer), []).append(i)
    left = []
    for cls, idx in by_cls.items():
        impl = _kernel_registry.requantize_many_impl_for(cls, dsts[idx[0]].device)
        if impl is None:
            left += idx
            continue
        sub_dsts, sub_hps = [dsts[i] for i in idx], [hps[i] for i in idx]
        undone = impl([d.quantizer for d in sub_dsts], sub_hps, sub_dsts, amax,
                      None if amax is None else [slots[i] for i in idx])
        undone_set = set(undone)
        for j, (d, hp) in enumerate(zip(sub_dsts, sub_hps)):
            if j not in undone_set and hp_init.kept(d) is not None:  # (``write`` alone enters no_grad)
                hp_init.write(d, hp)  # a kept init is what the data quantizes (hp_init note)
        left += [idx[j] for j in undone]
    return sorted(left)


__all__ = ["requantize_many_"]
