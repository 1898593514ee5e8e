"""The MoE MLP: a token-choice top-k router over SwiGLU experts built from
``hybrid_dist.moe.GroupedLinear`` (dropless; each expert's GEMMs run in the recipe's
formats with module_type ``"grouped_linear"``).

Legend: T tokens, D model dim, F expert ffn dim, E experts, K top-k.
The router stays high precision (a small ``nn.Linear`` left out of ``convert_to_hybrid``).
No load-balancing loss is added.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_dist.launch.presets import ModelConfig


class MoEFeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        from hybrid_dist.moe import GroupedLinear

        e = cfg.moe_experts
        self.top_k = cfg.moe_top_k
        self.router = nn.Linear(cfg.dim, e, bias=False)
        self.w1 = GroupedLinear(e, cfg.dim, cfg.ffn_dim)
        self.w3 = GroupedLinear(e, cfg.dim, cfg.ffn_dim)
        self.w2 = GroupedLinear(e, cfg.ffn_dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d, e = x.shape[-1], self.w1.num_experts
        x_TD = x.reshape(-1, d)
        probs_TE = self.router(x_TD).float().softmax(-1)
        weight_TK, expert_TK = probs_TE.topk(self.top_k, dim=-1)
        weight_TK = weight_TK / weight_TK.sum(-1, keepdim=True)
        flat = expert_TK.flatten()                                  # [T·K]
        order = flat.argsort(stable=True)                           # rows grouped by expert
        tokens_per_expert = torch.bincount(flat, minlength=e)       # [E] int64, on device
        xs = x_TD[order // self.top_k]                              # [T·K, D]
        h = self.w2(F.silu(self.w1(xs, tokens_per_expert)) * self.w3(xs, tokens_per_expert), tokens_per_expert)
        out = torch.empty_like(h).index_copy_(0, order, h)          # back to (token, k) order
        y_TD = (out.view(-1, self.top_k, d) * weight_TK.unsqueeze(-1).to(out.dtype)).sum(1)
        return y_TD.view_as(x)


def build_moe_mlp(cfg: ModelConfig) -> nn.Module:
    return MoEFeedForward(cfg)
