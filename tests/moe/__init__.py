"""CPU tests of hybrid_dist.moe."""
