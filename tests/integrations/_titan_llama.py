"""torchtitan's own Llama 3 at a tiny size for CPU tests: 2 blocks, dim 64, vocab 256, its
config-tree built by torchtitan's ``llama3`` helpers with SDPA attention (FlexAttention has
no CPU backward)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB, DIM, HEADS, LAYERS, SEQ = 256, 64, 4, 2, 32


def config(layers: int = LAYERS):
    import torchtitan.models.llama3 as llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    cfg = llama3.Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=llama3._output_linear_init(DIM)),
        layers=llama3._build_llama3_layers(
            n_layers=layers, dim=DIM, n_heads=HEADS, hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=64),
            rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=4 * SEQ, theta=500000, scaling="llama"),
            attn_backend="flex"))
    for _, _, parent, attr in list(cfg.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    return cfg


def build(cfg, seed: int = 0, *, meta: bool = False):
    """The model of ``cfg``, initialised as torchtitan's trainer does (``init_states``; with
    ``meta``, built on the meta device and materialised first) from ``seed``."""
    if meta:
        with torch.device("meta"):
            model = cfg.build()
        model.to_empty(device="cpu")
    else:
        model = cfg.build()
    torch.manual_seed(seed)
    model.init_states()
    return model


def batches(n: int, seed: int = 1, batch: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g) for _ in range(n)]


def loss_fn(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
