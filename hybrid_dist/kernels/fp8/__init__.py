"""Per-tensor and block FP8 kernels: the quantize kernels (one tensor, a batch, many tensors
per launch, the fused SwiGLU → FP8), the delayed-scaling update and the MoE kernels (the
per-expert cast into the packed layout, the grouped GEMMs)."""
