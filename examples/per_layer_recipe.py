"""A custom per-layer recipe: the first and last blocks in bf16, MXFP8 forward / NVFP4
backward everywhere else, trained next to plain bf16.

    python examples/per_layer_recipe.py                       # tiny, 4 blocks, CPU, ~10 s
    python examples/per_layer_recipe.py --preset 125m --layers 12 --steps 200 --device cuda

The recipe is the module attribute ``recipe``, so the launcher takes it as it is:

    torchrun --nproc-per-node 2 -m hybrid_dist.launch.train --preset tiny --layers 4 --fsdp 2 \\
        --recipe examples/per_layer_recipe.py:recipe

A recipe is a factory over roles (``hd.Role``: ``tensor_type`` in input / weight /
grad_output, ``module_type``, ``name`` the module's qualified name); this one reads the
block index from the name. The launcher's model names its blocks ``layers.<i>``.
"""

from __future__ import annotations

import argparse
import re

import torch
import torch.nn.functional as F

import hybrid_dist as hd

HIGH_PRECISION_BLOCKS = 1  # blocks kept in bf16 at each end of the stack
_BLOCK = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def per_layer_recipe(n_layers: int) -> hd.Recipe:
    """bf16 in the first and last ``HIGH_PRECISION_BLOCKS`` blocks (and outside blocks),
    ``mxfp8_fwd_nvfp4_bwd`` in the others."""
    bf16, hybrid = hd.recipe_from_name("bf16"), hd.recipe_from_name("mxfp8_fwd_nvfp4_bwd")

    def factory(role: hd.Role) -> hd.Quantizer:
        m = _BLOCK.search(role.name)
        inner = m is not None and HIGH_PRECISION_BLOCKS <= int(m.group(1)) < n_layers - HIGH_PRECISION_BLOCKS
        return (hybrid if inner else bf16).quantizer(role)

    return hd.CustomRecipe(factory, name=f"bf16_ends_mxfp8_fwd_nvfp4_bwd_{n_layers}")


recipe = per_layer_recipe(4)  # for a 4-block model (what --recipe path:recipe loads)


def train(recipe_: hd.Recipe | None, *, preset: str, layers: int, steps: int, device: str,
          seed: int = 0) -> list[float]:
    """Losses of ``steps`` AdamW steps of the launcher's Llama model under ``recipe_``."""
    from hybrid_dist.launch.data import make_data
    from hybrid_dist.launch.model import Transformer, apply_recipe
    from hybrid_dist.launch.presets import preset as preset_config

    cfg = preset_config(preset, layers=layers)
    torch.manual_seed(seed)
    model = Transformer(cfg).to(device)
    if recipe_ is not None:
        apply_recipe(model, recipe_)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = make_data(None, vocab_size=cfg.vocab_size, batch_size=8, seq_len=64, seed=seed, dp_rank=0)
    losses = []
    for step in range(1, steps + 1):
        tokens = data.batch(step).to(device)
        logits, _ = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def formats(recipe_: hd.Recipe, n_layers: int) -> list[str]:
    """The input quantizer of each block's first projection, one line per block."""
    return [f"layers.{i}: {type(recipe_.quantizer(hd.Role(tensor_type='input', name=f'layers.{i}.attention.wq'))).__name__}"
            for i in range(n_layers)]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    mixed = per_layer_recipe(args.layers)
    print("\n".join(formats(mixed, args.layers)))
    run = dict(preset=args.preset, layers=args.layers, steps=args.steps, device=args.device)
    out = {"bf16": train(None, **run), mixed.name: train(mixed, **run)}
    for name, losses in out.items():
        print(f"{name:40s} loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return out


if __name__ == "__main__":
    main()
