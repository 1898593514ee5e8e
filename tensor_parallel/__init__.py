"""hybrid_dist.tensor_parallel (see DESIGN §3)."""
