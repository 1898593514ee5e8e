"""A single-process demo: a small MLP learns a fixed random teacher under a hybrid recipe.

``python -m hybrid_dist.demo --recipe mxfp8_fwd_nvfp4_bwd --steps 200`` prints the loss
falling. The model is built under ``hd.quantized_model_init`` (parameters are
QuantizedTensors) and trained with ``hd.MasterWeightOptimizer`` (fp32 masters, in-place
re-quantization after each step). CPU runs the reference backend.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import hybrid_dist as hd

D_IN, D_HIDDEN, D_OUT, BATCH = 128, 256, 128, 128


def build_student(recipe: hd.Recipe, *, seed: int = 0, device: str = "cpu") -> nn.Module:
    torch.manual_seed(seed)
    with hd.quantized_model_init(recipe):
        return nn.Sequential(
            hd.Linear(D_IN, D_HIDDEN, recipe=recipe, device=device), nn.GELU(),
            hd.Linear(D_HIDDEN, D_OUT, recipe=recipe, device=device),
        )


def teacher_batches(steps: int, *, seed: int = 1, device: str = "cpu"):
    """Yields ``(x [BATCH, D_IN], y [BATCH, D_OUT])`` from a fixed random 2-layer teacher."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(D_IN, D_HIDDEN, generator=gen) / D_IN**0.5
    b = torch.randn(D_HIDDEN, D_OUT, generator=gen) / D_HIDDEN**0.5
    for _ in range(steps):
        x = torch.randn(BATCH, D_IN, generator=gen)
        yield x.to(device), (torch.tanh(x @ a) @ b).to(device)


def train(recipe_name: str, *, steps: int = 200, lr: float = 3e-3, log_every: int = 0,
          device: str = "cpu") -> list[float]:
    """Trains the student for ``steps`` steps; returns the loss of every step."""
    recipe = hd.recipe_from_name(recipe_name)
    model = build_student(recipe, device=device)
    opt = hd.MasterWeightOptimizer(torch.optim.AdamW, model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for step, (x, y) in enumerate(teacher_batches(steps, device=device)):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {loss.item():.5f}", flush=True)
    return losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="mxfp8_fwd_nvfp4_bwd", choices=hd.RECIPE_NAMES)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    t0 = time.perf_counter()
    losses = train(args.recipe, steps=args.steps, lr=args.lr, log_every=max(1, args.steps // 10), device=args.device)
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    print(f"recipe {args.recipe}: loss {first:.4f} -> {last:.4f} ({last / first:.1%} of start) "
          f"in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
