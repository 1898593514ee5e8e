"""Model presets: a CPU-sized ``tiny`` through ``125m`` and ``1b`` to a Llama-3-8B-shaped ``8b``.

Every projection dim is a multiple of 128, so each named recipe's blocks fit the weights
(FP8 block 128×128, MXFP8 32, NVFP4 16) in both directions; the tokens per rank
(``batch * seq``) must be a multiple of 128 too (checked by ``dry_run``/``train``).
``moe_experts > 0`` swaps the dense SwiGLU for a routed MoE MLP (``hybrid_dist.moe``).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Llama-style decoder shape. ``head_dim = dim // n_heads``."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    moe_experts: int = 0  # 0 = dense MLP
    moe_top_k: int = 2

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError(f"ModelConfig: dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelConfig: n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads} (GQA)")
        if self.moe_experts and not 1 <= self.moe_top_k <= self.moe_experts:
            raise ValueError(f"ModelConfig: moe_top_k={self.moe_top_k} must be in [1, moe_experts={self.moe_experts}]")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self, *, embeddings: bool = True) -> int:
        """Parameter count (untied input embedding and output head)."""
        kv = self.n_kv_heads * self.head_dim
        attn = self.dim * (2 * self.dim + 2 * kv)
        experts = max(self.moe_experts, 1)
        mlp = 3 * self.dim * self.ffn_dim * experts + (self.dim * self.moe_experts)
        per_layer = attn + mlp + 2 * self.dim
        n = self.n_layers * per_layer + self.dim
        return n + (2 * self.vocab_size * self.dim if embeddings else 0)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (6·N_active + attention), as PaLM / torchtitan count them."""
        kv = self.n_kv_heads * self.head_dim
        active_mlp = 3 * self.dim * self.ffn_dim * (self.moe_top_k if self.moe_experts else 1)
        n_active = self.n_layers * (self.dim * (2 * self.dim + 2 * kv) + active_mlp) + self.vocab_size * self.dim
        return 6 * n_active + 12 * self.n_layers * self.dim * seq_len


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512, vocab_size=512,
                        max_seq_len=256),
    "125m": ModelConfig(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048, vocab_size=32768,
                        max_seq_len=2048),
    "1b": ModelConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=128256,
                      max_seq_len=8192, rope_theta=500000.0),
    "8b": ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256,
                      max_seq_len=8192, rope_theta=500000.0),
}


def preset(name: str, *, moe_experts: int = 0, moe_top_k: int = 2, layers: int = 0) -> ModelConfig:
    """The named preset, optionally as an MoE variant (each expert keeps ``ffn_dim``) and
    with ``layers`` blocks instead of the preset's ``n_layers`` (0 keeps it)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets are {', '.join(PRESETS)}")
    cfg = PRESETS[name]
    if layers:
        cfg = dataclasses.replace(cfg, n_layers=layers)
    if moe_experts:
        cfg = dataclasses.replace(cfg, moe_experts=moe_experts, moe_top_k=moe_top_k)
    return cfg
