"""One Llama block fwd+bwd per recipe, with and without shared input quantization
(eager: ``hd.RMSNorm`` / ``hd.SwiGLU`` quantizing their output once for the linked
``hd.Linear`` layers; compiled: ``hd.compile_options()``, identical casts launched once)
against the same block in plain PyTorch bf16 (``nn.Linear``, ``nn.RMSNorm``,
``F.silu(a) * b``). Prints one table.
Run: ``python -m benchmarks.block`` (``--preset 1b``, ``--tokens 8192``, ``--recipes ...``).

``ms`` = median step (CUDA events); ``launches`` = kernel launches per step (profiled
once). Parameters are bf16 (as FSDP2's mixed precision hands them to the block); the
block sees ``[1, tokens, dim]`` activations.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util

import torch

import hybrid_dist as hd
from benchmarks._bench import bench_ms, host_calls, print_profile, print_table, profile_step
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


def _build(cfg, recipe_name: str, shared: bool, *, qinit: bool = False, compile: bool = False):
    """``recipe_name``: a named recipe, ``torch`` (plain PyTorch bf16) or ``torchao`` (that
    block converted by torchao's float8 tensorwise training). ``qinit``: block weights
    created under ``hd.quantized_model_init``."""
    torch.manual_seed(0)
    plain = recipe_name in ("torch", "torchao")
    init = hd.quantized_model_init(hd.recipe_from_name(recipe_name), keep_high_precision_init=False) \
        if qinit and not plain else contextlib.nullcontext()
    with torch.device("cuda"), init:
        model = _TorchBlock(cfg) if plain else _OneBlock(cfg)
    model = model.to(torch.bfloat16)
    if recipe_name == "torchao":
        from hybrid_dist.launch import torchao_baseline

        torchao_baseline.convert(model)
    elif not plain:
        apply_recipe(model, hd.recipe_from_name(recipe_name), share_quantized_inputs=shared and not compile)
    if compile:
        model.layers["0"] = torch.compile(model.layers["0"], options=hd.compile_options() if shared else {})
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
    ap.add_argument("--compile", action="store_true", help="torch.compile the block (shared: with "
                    "hd.compile_options()); adds torchao float8 tensorwise when torchao imports")
    ap.add_argument("--qinit", action="store_true", help="recipes' weights from hd.quantized_model_init")
    ap.add_argument("--profile", action="store_true", help="print each configuration's top kernels")
    args = ap.parse_args()
    cfg = dataclasses.replace(preset(args.preset), n_layers=1, max_seq_len=max(args.tokens, 128))
    base_ms = None
    rows = []
    shares = (False, True)
    configs = [("torch", False), ("bf16", False)] + [(r, s) for r in args.recipes.split(",") for s in shares]
    if args.compile and importlib.util.find_spec("torchao") is not None:
        configs.insert(1, ("torchao", False))
    for name, shared in configs:
        model = _build(cfg, name, shared, qinit=args.qinit, compile=args.compile)
        step = _step_fn(model, cfg, args.tokens)
        ms = bench_ms(step, warmup_ms=100, rep_ms=400)
        base_ms = base_ms or ms
        label = {"torch": "nn.Linear, nn.RMSNorm", "torchao": "Float8Linear"}.get(
            name, "shared" if shared else "per layer")
        rows.append([name, label, ms, base_ms / ms, _launches(step)])
        if args.profile:
            print_profile(step, f"{name} ({label})", rows=12)
        del model, step
        torch.cuda.empty_cache()
    mode = (", compiled" if args.compile else "") + (", quantized init" if args.qinit else "")
    print_table(["recipe", "input quantization", "ms", "x torch bf16", "launches"], rows,
                f"## block fwd+bwd, preset {args.preset} (dim {cfg.dim}, ffn {cfg.ffn_dim}), "
                f"{args.tokens} tokens{mode}, {torch.cuda.get_device_name()}")


if __name__ == "__main__":
    main()
