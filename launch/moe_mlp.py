"""The MoE MLP: ``hybrid_dist.moe.MoE`` (dropless top-k router, SwiGLU experts as
``GroupedLinear`` fc1 ``[E, 2F, D]`` / fc2 ``[E, D, F]``, load-balancing loss), optionally
expert-parallel over an EP process group.

``MoEFeedForward.forward(x) -> (y, aux_loss)``; the block adds ``aux_loss`` up the stack
and the training loss weights it by ``--moe-aux-loss-coef``. The router stays high
precision (``hybrid_filter`` leaves it out of ``convert_to_hybrid``).
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid_dist.launch.presets import ModelConfig


class MoEFeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig, *, ep_group=None):
        super().__init__()
        from hybrid_dist.moe import MoE

        self.moe = MoE(cfg.dim, cfg.ffn_dim, cfg.moe_experts, cfg.moe_top_k, ep_group=ep_group)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.moe(x)

    def expert_modules(self) -> list[nn.Module]:
        """The modules holding this rank's experts (sharded over the EP-complement mesh)."""
        return [self.moe.fc1, self.moe.fc2]
