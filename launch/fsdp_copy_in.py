"""``--fsdp-copy-in``: the launcher puts ``fsdp2.grad_copy_in.copy_in`` in FSDP2's place.

FSDP2 packs a module's gradients for the reduce-scatter in the private function
``_fsdp_collectives.foreach_reduce_scatter_copy_in(grads, out, world_size)``, which
``foreach_reduce`` looks up at each call; it has no extension point for this step (a custom
``ReduceScatter`` chooses the buffer and the collective, not the packing). The training job,
an application that owns its process, replaces that function (``auto``, the default, and
``hd``) after checking that this torch's ``foreach_reduce`` calls it in the form replaced;
the library never does.
A traced step keeps FSDP2's own (``torch.ops.fsdp.chunk_cat``).
"""

from __future__ import annotations

import inspect

import torch

from hybrid_dist.fsdp2.grad_copy_in import copy_in

__all__ = ["choose", "install", "installed", "uninstall"]

_CALL = "foreach_reduce_scatter_copy_in(unsharded_grads, reduce_scatter_input, world_size)"


def _fsdp_collectives():
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    return _fsdp_collectives


def _replacement(original):
    def foreach_reduce_scatter_copy_in(unsharded_grads, reduce_scatter_input, world_size):
        if torch.compiler.is_compiling():
            return original(unsharded_grads, reduce_scatter_input, world_size)
        copy_in(unsharded_grads, reduce_scatter_input, world_size)

    foreach_reduce_scatter_copy_in.hd_original = original
    return foreach_reduce_scatter_copy_in


def install() -> bool:
    """Replace FSDP2's gradient copy-in by ``copy_in`` (idempotent). False, with nothing
    changed, where this torch's FSDP2 does not call it as ``foreach_reduce`` does in 2.11
    and 2.13 (the only form this replaces)."""
    mod = _fsdp_collectives()
    current = getattr(mod, "foreach_reduce_scatter_copy_in", None)
    if current is None:
        return False
    if getattr(current, "hd_original", None) is not None:
        return True
    params = list(inspect.signature(current).parameters)
    if params != ["unsharded_grads", "reduce_scatter_input", "world_size"] or \
            _CALL not in inspect.getsource(mod.foreach_reduce):
        return False
    mod.foreach_reduce_scatter_copy_in = _replacement(current)
    return True


def installed() -> bool:
    current = getattr(_fsdp_collectives(), "foreach_reduce_scatter_copy_in", None)
    return getattr(current, "hd_original", None) is not None


def uninstall() -> None:
    """Restore FSDP2's own copy-in."""
    mod = _fsdp_collectives()
    original = getattr(mod.foreach_reduce_scatter_copy_in, "hd_original", None)
    if original is not None:
        mod.foreach_reduce_scatter_copy_in = original


def choose(choice: str) -> bool:
    """Apply the launcher's ``--fsdp-copy-in`` choice process-wide and say whether ``copy_in``
    is in place: ``torch`` restores FSDP2's own; ``hd`` installs ours or raises where this torch
    does not allow it; ``auto`` installs ours where it can and keeps FSDP2's own otherwise."""
    if choice == "torch":
        uninstall()
        return False
    if install():
        return True
    if choice == "hd":
        raise ValueError("--fsdp-copy-in hd: this torch's FSDP2 does not pack gradients through "
                         f"{_CALL}; use --fsdp-copy-in torch or auto")
    return False
