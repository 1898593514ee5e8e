"""One Llama block fwd+bwd per recipe, with and without shared input quantization
(``hd.RMSNorm`` / ``hd.SwiGLU`` quantizing their output once for the linked ``hd.Linear``
layers) against the same block in plain PyTorch bf16 (``nn.Linear``, ``nn.RMSNorm``,
``F.silu(a) * b``). Prints one table.
Run: ``python -m benchmarks.block`` (``--preset 1b``, ``--tokens 8192``, ``--recipes ...``).

``ms`` = median step (CUDA events); ``launches`` = kernel launches per step (profiled
once). Parameters are bf16 (as FSDP2's mixed precision hands them to the block); the
block sees ``[1, tokens, dim]`` activations.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

import hybrid_dist as hd
from benchmarks._bench import bench_ms, host_calls, print_table, profile_step
from hybrid_dist.launch.model import Block, apply_recipe, rope_tables
from hybrid_dist.launch.presets import preset


class _OneBlock(torch.nn.Module):
    """A block in the shape ``apply_recipe``/``link_shared_inputs`` expect (``.layers``, ``.cfg``)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.layers = torch.nn.ModuleDict({"0": Block(cfg)})


class _TorchBlock(_OneBlock):
    """The same block of ``nn.Linear``, ``nn.RMSNorm`` and ``F.silu(a) * b`` (plain PyTorch)."""

    def __init__(self, cfg):
        torch.nn.Module.__init__(self)
        self.cfg = cfg
        self.layers = torch.nn.ModuleDict({"0": Block(cfg, linear=torch.nn.Linear)})


def _build(cfg, recipe_name: str, shared: bool):
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = _TorchBlock(cfg) if recipe_name == "torch" else _OneBlock(cfg)
    model = model.to(torch.bfloat16)
    if recipe_name != "torch":
        apply_recipe(model, hd.recipe_from_name(recipe_name), share_quantized_inputs=shared)
    return model


def _step_fn(model, cfg, tokens: int):
    cos, sin = rope_tables(cfg, device="cuda")
    x = torch.randn(1, tokens, cfg.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    aux = torch.zeros((), device="cuda")
    params = list(model.parameters())
    block = model.layers["0"]

    def step():
        out, _ = block(x, cos, sin, aux)
        return torch.autograd.grad(out, [x, *params], dy)
    return step


def _launches(step) -> float:
    return host_calls(profile_step(step))[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="8b")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--recipes", default="fp8_current,mxfp8,fp8_block")
    args = ap.parse_args()
    cfg = dataclasses.replace(preset(args.preset), n_layers=1, max_seq_len=max(args.tokens, 128))
    base_ms = None
    rows = []
    configs = [("torch", False), ("bf16", False)] + [(r, s) for r in args.recipes.split(",") for s in (False, True)]
    for name, shared in configs:
        model = _build(cfg, name, shared)
        step = _step_fn(model, cfg, args.tokens)
        ms = bench_ms(step, warmup_ms=100, rep_ms=400)
        base_ms = base_ms or ms
        label = "nn.Linear, nn.RMSNorm" if name == "torch" else ("shared" if shared else "per layer")
        rows.append([name, label, ms, base_ms / ms, _launches(step)])
        del model, step
        torch.cuda.empty_cache()
    print_table(["recipe", "input quantization", "ms", "x torch bf16", "launches"], rows,
                f"## block fwd+bwd, preset {args.preset} (dim {cfg.dim}, ffn {cfg.ffn_dim}), "
                f"{args.tokens} tokens, {torch.cuda.get_device_name()}")


if __name__ == "__main__":
    main()
