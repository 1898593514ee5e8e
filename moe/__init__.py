"""hybrid_dist.moe: grouped expert GEMMs with per-expert quantization, a dropless top-k
MoE layer and expert-parallel token exchange (see docs/design.md §3)."""

from hybrid_dist.moe.device_split import PackedSplit, split_quantize_packed
from hybrid_dist.moe.expert_parallel import WireStats
from hybrid_dist.moe.grouped_linear import GroupedLinear, GroupedPlan, apply_grouped_linear
from hybrid_dist.moe.layer import MoE
from hybrid_dist.moe.permute import permute, unpermute
from hybrid_dist.moe.router import TopKRouter, load_balancing_loss
from hybrid_dist.moe.split_quantize import GroupedQuantized, split_quantize, token_multiple

__all__ = [
    "GroupedLinear", "GroupedPlan", "GroupedQuantized", "MoE", "PackedSplit", "TopKRouter", "WireStats",
    "apply_grouped_linear", "load_balancing_loss", "permute", "split_quantize", "split_quantize_packed",
    "token_multiple", "unpermute",
]
