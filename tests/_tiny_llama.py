"""A Llama-shaped causal LM in plain torch (``nn.Linear`` projections, ``nn.Embedding``,
``nn.RMSNorm``, causal SDPA): the kind of existing model users hand to
``hd.convert_to_hybrid``. Every Linear dim is a multiple of 128 (FP8 128×128 weight
blocks), also for each of 2 FSDP2 shards, and ``TOKENS`` rows fill 128-row blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, FFN, HEADS, LAYERS = 256, 256, 512, 4, 2
BATCH, SEQ = 2, 64  # TOKENS = 128 rows per GEMM
TOKENS = BATCH * SEQ


class Block(nn.Module):
    def __init__(self, dim: int, ffn: int, heads: int):
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(dim, ffn, bias=False), nn.Linear(dim, ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)

    def forward(self, h_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = h_BTD.shape
        x = self.attn_norm(h_BTD)
        q, k, v = (proj(x).view(B, T, self.heads, D // self.heads).transpose(1, 2) for proj in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
        h_BTD = h_BTD + self.o(att)
        x = self.mlp_norm(h_BTD)
        return h_BTD + self.down(F.silu(self.gate(x)) * self.up(x))


class TinyLlama(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = DIM, ffn: int = FFN, heads: int = HEADS, layers: int = LAYERS):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, ffn, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens_BT)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(self.norm(h))


def build(seed: int = 0) -> TinyLlama:
    torch.manual_seed(seed)
    return TinyLlama()


def batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    """``n`` token batches ``[BATCH, SEQ + 1]`` (inputs and next-token targets)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen) for _ in range(n)]


def loss_fn(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
