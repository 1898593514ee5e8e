"""Device-side input checks shared by the MoE grouped paths (no host sync)."""

from __future__ import annotations

import torch

__all__ = ["check_token_counts"]


def check_token_counts(tokens_per_expert: torch.Tensor, num_tokens: int, who: str) -> None:
    """Counts must be >= 0 and sum to the token count; checked on the device (no host sync):
    a CPU tensor raises here, a CUDA one at the next synchronization."""
    ok = (tokens_per_expert >= 0).all() & (tokens_per_expert.sum() == num_tokens)
    torch._assert_async(ok, f"{who}: tokens_per_expert must be >= 0 and sum to the {num_tokens} rows of x")
