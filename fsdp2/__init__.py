"""hybrid_dist.fsdp2 (see DESIGN §3)."""
