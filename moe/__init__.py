"""hybrid_dist.moe: grouped expert GEMMs with per-expert quantization, a dropless top-k
MoE layer and expert-parallel token exchange (see DESIGN §3)."""

from hybrid_dist.moe.grouped_linear import GroupedLinear
from hybrid_dist.moe.split_quantize import GroupedQuantized, split_quantize, token_multiple

__all__ = ["GroupedLinear", "GroupedQuantized", "split_quantize", "token_multiple"]
