"""The optimizer step of quantized weights on one GPU: ``hd.MasterWeightOptimizer`` (fused
AdamW over fp32 masters, then every weight re-quantized in place) against fused AdamW on
fp32 parameters plus torchao's per-step weight amax (``torch._foreach_norm(inf)``).

The weights are one FSDP rank's shards of a Llama stack (``--preset``, ``--layers``,
``--shards``): each block's seven projections with dim 0 divided by ``--shards``. Prints
the median step (CUDA events) of each and the top kernels of one hd step.
Run: ``python -m benchmarks.optimizer_step --preset 8b --layers 16 --shards 4``.
"""

from __future__ import annotations

import argparse

import torch

import hybrid_dist as hd
from benchmarks._bench import bench_ms, print_profile, print_table
from hybrid_dist.launch.presets import preset


def shard_shapes(cfg, shards: int) -> list[tuple[int, int]]:
    kv = cfg.n_kv_heads * cfg.head_dim
    per_block = [(cfg.dim, cfg.dim), (kv, cfg.dim), (kv, cfg.dim), (cfg.dim, cfg.dim),
                 (cfg.ffn_dim, cfg.dim), (cfg.ffn_dim, cfg.dim), (cfg.dim, cfg.ffn_dim)]
    return [(o // shards, i) for _ in range(cfg.n_layers) for o, i in per_block]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="8b")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--recipe", default="fp8_current")
    args = ap.parse_args()
    cfg = preset(args.preset, layers=args.layers)
    shapes = shard_shapes(cfg, args.shards)
    recipe = hd.recipe_from_name(args.recipe)
    torch.manual_seed(0)
    with torch.device("cuda"), hd.quantized_model_init(recipe, keep_high_precision_init=False):
        layers = [hd.Linear(i, o, bias=False) for o, i in shapes]
    qparams = [m.weight for m in layers]
    hd_opt = hd.MasterWeightOptimizer(torch.optim.AdamW, qparams, lr=1e-4, fused=True)
    fparams = [torch.nn.Parameter(torch.randn(o, i, device="cuda") * 0.02) for o, i in shapes]
    ref_opt = torch.optim.AdamW(fparams, lr=1e-4, fused=True)
    for p in qparams + fparams:
        p.grad = torch.randn(p.shape, device="cuda") * 1e-3

    def hd_step():
        hd_opt.step()

    def ref_step():
        ref_opt.step()
        with torch.no_grad():
            torch._foreach_norm(fparams, float("inf"))  # torchao's precompute: one amax per weight

    numel = sum(o * i for o, i in shapes)
    rows = []
    for name, fn in (("fused AdamW fp32 + amax (torchao-like)", ref_step), (f"hd.MasterWeightOptimizer {args.recipe}",
                                                                             hd_step)):
        rows.append([name, bench_ms(fn, warmup_ms=200, rep_ms=1000)])
    base = rows[0][1]
    for r in rows:
        r.append(base / r[1])
    print_profile(hd_step, f"hd step ({len(shapes)} weights, {numel / 1e6:.0f} M elements)", rows=15)
    print_table(["step", "ms", "x baseline"], rows,
                f"## optimizer step, {args.preset} L{args.layers} shards of 1/{args.shards}, "
                f"{len(shapes)} weights, {torch.cuda.get_device_name()}")


if __name__ == "__main__":
    main()
