"""torchtitan's Qwen3 MoE at a tiny size for CPU tests: 2 blocks, dim 64, 4 experts of hidden
dim 64 (top 2), vocab 256, built by torchtitan's ``qwen3`` helpers (those of its
``debugmodel_moe`` flavor) with SDPA attention (FlexAttention has no CPU backward). Built,
initialised and trained as ``_titan_llama``."""

from __future__ import annotations

from tests.integrations._titan_llama import batches, build, loss_fn  # noqa: F401 (re-export)

VOCAB, DIM, HEAD_DIM, HIDDEN, EXPERTS, TOP_K, LAYERS, SEQ = 256, 64, 16, 64, 4, 2, 2, 32
EXPERTS_FQNS = [f"layers.{i}.moe.routed_experts.inner_experts" for i in range(LAYERS)]


def config(*, dim: int = DIM, hidden: int = HIDDEN, layers: int = LAYERS):
    from torchtitan.models import qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    cfg = qwen3.Qwen3Model.Config(
        vocab_size=VOCAB, dim=dim, norm=qwen3._qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim, param_init=qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=qwen3._LINEAR_INIT),
        layers=qwen3._build_qwen3_moe_layers(
            fuse_qkv=True, n_layers=layers, dim=dim, n_heads=4, n_kv_heads=2, head_dim=HEAD_DIM,
            moe_hidden_dim=hidden, num_experts=EXPERTS, top_k=TOP_K, attn_backend="flex", moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=4 * SEQ, theta=1e6)))
    for _, _, parent, attr in list(cfg.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    return cfg
