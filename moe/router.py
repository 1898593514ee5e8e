"""Softmax top-k router and the load-balancing auxiliary loss.

Legend: T tokens, H hidden, E experts, k experts per token.

    logits [T, E] = x [T, H] · W_g [E, H]ᵀ       (fp32: routing stays high precision)
    probs  [T, E] = softmax(logits)
    weights, experts [T, k] = top-k(probs)       (renormalised to sum 1 if norm_topk_prob)

Load-balancing loss (Switch Transformer / GShard form, as torchtitan and Megatron):

    aux = E · Σ_e f_e · P_e,   f_e = (#slots routed to e) / (T·k),   P_e = mean_t probs[t, e]

``f`` is a count (no gradient); the gradient flows through ``P``. Counts use
``scatter_add_`` on device, so no host sync.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["TopKRouter", "load_balancing_loss", "expert_counts"]


def expert_counts(experts_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 ``[E]`` number of slots routed to each expert (device-side, no sync)."""
    flat = experts_TK.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))


def load_balancing_loss(probs_TE: torch.Tensor, experts_TK: torch.Tensor) -> torch.Tensor:
    """``E · Σ_e f_e · P_e`` (fp32 scalar; 0 for zero tokens)."""
    t, e = probs_TE.shape
    if t == 0:
        return probs_TE.sum() * 0.0
    f = expert_counts(experts_TK, e).float() / experts_TK.numel()
    return e * (f * probs_TE.float().mean(0)).sum()


class TopKRouter(nn.Module):
    """``forward(x [T, H]) -> (weights [T, k] fp32, experts [T, k] int64, probs [T, E] fp32)``."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, *, norm_topk_prob: bool = True,
                 device=None, dtype=None):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.gate = nn.Linear(hidden, num_experts, bias=False, device=device, dtype=dtype)

    def forward(self, x_TH: torch.Tensor):
        logits = torch.nn.functional.linear(x_TH.float(), self.gate.weight.float())
        probs = logits.softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts, probs
