"""Which directions an FSDP2 all-gather needs, read from FSDP's own training state.

FSDP2 calls ``fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)``
with ``module`` = the module that owns the parameter (often a child of the module that
``fully_shard`` was applied to). We find the ``FSDPParamGroup`` that manages that
parameter (through ``torch.distributed._composable_state``, cached per module) and read:

* ``group.post_forward_mesh_info is None`` (``reshard_after_forward=False``, the default
  for the root): the forward gather must serve backward too → both directions;
* ``group._training_state == TrainingState.PRE_BACKWARD`` (set by FSDP for the backward
  unshard and for backward prefetches): columnwise (dgrad operand);
* otherwise (forward, forward prefetch, explicit ``unshard()``): rowwise (fprop operand).

Without an FSDP group (a hook called outside ``fully_shard``) both directions are
gathered.

[Note: activation recompute]
A module whose forward is recomputed in backward (``torch.utils.checkpoint``, non-
reentrant) needs the rowwise direction (the recomputed fprop) *and* the columnwise one
(dgrad) from the backward gather. FSDP2 reuses each parameter's all-gather buffers, so
every gather of that parameter must have the same signature: its forward gathers both
directions too (``"forward_both"``, as ``reshard_after_forward=False`` would) and its
backward gathers both again (``"recompute_both"``). A forward gather is recompute-bound
when it runs inside a checkpointed forward (the checkpoint's saved-tensor hooks are the
innermost ones; ``checkpoint(fsdp_module, x)``), or when the parameter's module sits
inside a ``CheckpointWrapper`` (``checkpoint_wrapper`` applied before ``fully_shard``, to
the FSDP module or to one containing it, as a checkpointed block contains its experts'
FSDP group);
the mark is kept on the shard for the backward gathers of the same step. A recompute that
was not detected raises instead of reading stale bytes: a forward gather inside backward
(reentrant checkpoint, whose forward runs without saved-tensor hooks) raises
``NotImplementedError``, and a module that reads the hidden rowwise direction gets a
``ValueError`` naming it.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

FORWARD, BACKWARD, BOTH = "forward", "backward", "forward_both"
RECOMPUTE = "recompute_both"  # backward gather of a recomputed module: both directions
_CKPT_OWNER: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def gathers_both(pass_: str) -> bool:
    """True for the passes that carry both directions."""
    return pass_ in (BOTH, RECOMPUTE)

_GROUP_OF: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


def _param_groups(state) -> list:
    groups = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.12: a list
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)  # torch 2.11
        groups = [] if group is None else [group]
    return list(groups)


def _find_group(module: nn.Module, local_tensor: torch.Tensor):
    from torch.distributed import _composable_state as cs
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    cached = _GROUP_OF.get(module)
    group = cached() if cached is not None else None
    if group is not None:
        return group
    fallback = None
    for ref in list(cs._module_state_mapping.values()):
        state = ref()
        if not isinstance(state, FSDPState):
            continue
        for g in _param_groups(state):
            for fp in g.fsdp_params:
                info = fp._module_info
                if info.module is module or any(m is module for m in info.shared_modules):
                    if fp.sharded_param._local_tensor is local_tensor:
                        _GROUP_OF[module] = weakref.ref(g)
                        return g
                    fallback = fallback or g
    if fallback is not None:
        _GROUP_OF[module] = weakref.ref(fallback)
    return fallback


def is_fsdp_shard(module: nn.Module | None, local_tensor: torch.Tensor) -> bool:
    """True when ``local_tensor`` is FSDP's own sharded local tensor (not a copy FSDP made
    for this gather, as CPU offload's copy to the device is)."""
    group = None if module is None else _find_group(module, local_tensor)
    return group is not None and any(fp.sharded_param._local_tensor is local_tensor for fp in group.fsdp_params)


def gather_pass(module: nn.Module | None, local_tensor: torch.Tensor) -> str:
    """``"forward"`` (rowwise), ``"backward"`` (columnwise) or ``"forward_both"``."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    group = None if module is None else _find_group(module, local_tensor)
    if group is None or group.post_forward_mesh_info is None:
        return BOTH
    if group.post_forward_mesh_info != group.mesh_info:
        raise NotImplementedError(
            "hybrid_dist.fsdp2: reshard_after_forward=<int> (resharding to a smaller mesh after "
            "forward) is not supported for quantized parameters; use True or False."
        )
    if group._training_state == TrainingState.PRE_BACKWARD:
        return RECOMPUTE if getattr(local_tensor, "_hd_recomputed", False) else BACKWARD
    recomputed = _in_checkpointed_forward() or _in_checkpoint_wrapper(module, group)
    if not recomputed and torch._C._current_graph_task_id() != -1:
        raise NotImplementedError(
            "hybrid_dist.fsdp2: a forward all-gather of a quantized parameter ran inside backward: "
            "an activation recompute whose original forward was not seen as checkpointed (e.g. "
            "torch.utils.checkpoint(..., use_reentrant=True)). Use use_reentrant=False or "
            "checkpoint_wrapper before fully_shard, or reshard_after_forward=False for that module.")
    local_tensor._hd_recomputed = recomputed
    return BOTH if recomputed else FORWARD


def _in_checkpointed_forward() -> bool:
    """True inside the forward of a non-reentrant ``torch.utils.checkpoint``: its
    saved-tensor hooks (``_checkpoint_hook``) are the innermost default hooks."""
    top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    top = top_hooks(True) if top_hooks is not None else None
    return top is not None and getattr(top[0], "__qualname__", "").startswith("_checkpoint_hook.")


def _in_checkpoint_wrapper(module: nn.Module, group) -> bool:
    """True if ``module`` is inside a ``CheckpointWrapper``: within the FSDP group's modules,
    or an ancestor of them (an expert group nested in a checkpointed block, sharded over its
    own mesh, is recomputed with the block), found from every FSDP module's tree (cached per
    module)."""
    if module in _CKPT_OWNER:
        return _CKPT_OWNER[module]
    from torch.distributed import _composable_state as cs
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    roots = list(getattr(group, "modules", None) or ())
    roots += [m for m in list(cs._module_state_mapping) if m not in roots]
    # nested FSDP modules' trees overlap: each wrapper is searched once
    wrappers = {id(w): w for root in roots for w in root.modules() if isinstance(w, CheckpointWrapper)}
    found = any(any(sub is module for sub in w.modules()) for w in wrappers.values())
    _CKPT_OWNER[module] = found
    return found
