"""hybrid_dist.moe (see DESIGN §3)."""
