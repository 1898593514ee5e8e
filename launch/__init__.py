"""hybrid_dist.launch (see DESIGN §3)."""
