"""Train torchtitan's Llama 3 with a hybrid recipe chosen by configuration alone.

    python examples/torchtitan_converter.py                              # tiny, CPU, ~20 s
    python examples/torchtitan_converter.py --moe                        # tiny Qwen3 MoE, experts too
    python examples/torchtitan_converter.py --recipe examples/per_layer_recipe.py:recipe
    python examples/torchtitan_converter.py --flavor debugmodel --device cuda --steps 100

In a torchtitan config registry the converter is one entry of ``converters``, as its own
float8 converter is; ``torchtitan.train`` then runs it with everything torchtitan does
(FSDP2, TP, compile, checkpoints)::

    def llama3_8b_hybrid() -> Trainer.Config:
        config = llama3_8b()
        config.model_spec = model_registry("8B", converters=[HybridLinearConverter.Config(
            recipe="mxfp8_fwd_nvfp4_bwd", quantized_all_gather=True)])
        return config

This script builds the model the same way (``model_registry(flavor, converters=[...])``, or
for the tiny default the same config helpers at dim 64 with SDPA attention, since
FlexAttention has no CPU backward), materialises it from the meta device as torchtitan's
trainer does, and trains it next to the unconverted model on a few fixed batches. With
``--moe`` the tiny model is torchtitan's Qwen3 MoE (4 experts of hidden dim 64, top 2): its
``GroupedExperts`` become ``HybridGroupedExperts`` (the router's 4-wide gate is left out).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from hybrid_dist.integrations.torchtitan import HybridGroupedExperts, HybridLinear, HybridLinearConverter


def tiny_config(layers: int):
    """torchtitan's Llama 3 config at dim 64, vocab 256, SDPA attention (CPU)."""
    import torchtitan.models.llama3 as llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    dim, heads, vocab = 64, 4, 256
    cfg = llama3.Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=llama3._output_linear_init(dim)),
        layers=llama3._build_llama3_layers(
            n_layers=layers, dim=dim, n_heads=heads, hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=64),
            rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=1024, theta=500000, scaling="llama"),
            attn_backend="flex"))
    for _, _, parent, attr in list(cfg.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    return cfg


def tiny_moe_config(layers: int):
    """torchtitan's Qwen3 MoE config at dim 64, 4 experts (top 2), vocab 256, SDPA attention."""
    from torchtitan.models import qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    dim, head_dim, vocab = 64, 16, 256
    cfg = qwen3.Qwen3Model.Config(
        vocab_size=vocab, dim=dim, norm=qwen3._qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=qwen3._LINEAR_INIT),
        layers=qwen3._build_qwen3_moe_layers(
            n_layers=layers, dim=dim, n_heads=4, n_kv_heads=2, head_dim=head_dim, moe_hidden_dim=64, num_experts=4,
            top_k=2, attn_backend="flex", moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=1024, theta=1e6)))
    for _, _, parent, attr in list(cfg.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    return cfg


def model_config(args, converters: list):
    if args.flavor == "tiny":
        cfg = tiny_moe_config(args.layers) if args.moe else tiny_config(args.layers)
        for c in converters:
            cfg = c.build().convert(cfg)
        return cfg
    from torchtitan.models.llama3 import model_registry

    return model_registry(args.flavor, converters=converters).model


def build(cfg, device: str, seed: int):
    with torch.device("meta"):
        model = cfg.build()
    model.to_empty(device=device)
    torch.manual_seed(seed)
    model.init_states(buffer_device=torch.device(device))
    return model


def train(model, args, vocab: int) -> list[float]:
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g).to(args.device) for _ in range(2)]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        tokens = data[step % len(data)]
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default="mxfp8_fwd_nvfp4_bwd", help="a named recipe or module:attr / file.py:attr")
    p.add_argument("--flavor", default="tiny", help="tiny (CPU), or a torchtitan llama3 flavor (debugmodel, 8B, ...)")
    p.add_argument("--layers", type=int, default=2, help="blocks of the tiny model")
    p.add_argument("--moe", action="store_true", help="the tiny model is a Qwen3 MoE (experts converted too)")
    p.add_argument("--quantized-all-gather", action="store_true", help="FSDP2 gathers weights quantized")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    converter = HybridLinearConverter.Config(recipe=args.recipe, quantized_all_gather=args.quantized_all_gather,
                                             filter_fqns=["router.gate"] if args.moe else [])
    out = {}
    for name, converters in (("unconverted", []), (args.recipe, [converter])):
        model = build(model_config(args, converters), args.device, seed=0)
        out[name] = train(model, args, model.tok_embeddings.num_embeddings)
    linears = sum(isinstance(m, HybridLinear) for m in model.modules())
    experts = sum(isinstance(m, HybridGroupedExperts) for m in model.modules())
    print(f"{linears} Linears converted to HybridLinear" + (f", {experts} experts to HybridGroupedExperts"
                                                            if args.moe else ""))
    for name, losses in out.items():
        print(f"{name:40s} loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return out


if __name__ == "__main__":
    main()
