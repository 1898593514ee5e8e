"""Token permutation (sort slots by expert) and unpermutation (weighted combine).

A *slot* is one (token, choice) pair: slot ``s = t·k + j`` for token t's j-th expert.

    permute   x [T, H], experts [T, k] → x_perm [T·k, H] (slots sorted by expert, stable,
              so each expert sees its tokens in token order), tokens_per_expert [E],
              order [T·k] (slot index of each permuted row)
    unpermute y_perm [T·k, H], order, weights [T, k] → y [T, H] = Σ_j weights[t, j] · y_slot

Both are fixed-shape (T·k rows: dropless) device ops with no host sync. The combine sums
each token's k slots in a fixed order (a reduction over dim 1 of ``[T, k, H]``), so the
result does not depend on where the slots were computed (expert parallel = single rank).
"""

from __future__ import annotations

import torch

from hybrid_dist.moe.router import expert_counts

__all__ = ["permute", "unpermute"]


def permute(x_TH: torch.Tensor, experts_TK: torch.Tensor, num_experts: int):
    """``(x_perm [T·k, H], tokens_per_expert [E] int64, order [T·k])``; see module doc."""
    t, k = experts_TK.shape
    order = torch.argsort(experts_TK.reshape(-1), stable=True)
    x_slots = x_TH.unsqueeze(1).expand(t, k, x_TH.shape[-1]).reshape(t * k, -1)
    return x_slots[order], expert_counts(experts_TK, num_experts), order


def unpermute(y_perm: torch.Tensor, order: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """``y [T, H]`` in ``y_perm``'s dtype; see module doc."""
    t, k = weights_TK.shape
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    y_slots = y_perm[inverse].reshape(t, k, -1)
    return (y_slots.float() * weights_TK.unsqueeze(-1)).sum(dim=1).to(y_perm.dtype)
