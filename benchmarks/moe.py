"""``moe.GroupedLinear`` fwd+bwd step time per recipe against bf16 ``torch._grouped_mm``
fwd+bwd, at DeepSeek-V3-like expert shapes: E=8 experts, K=7168, N=2048, T=32768 tokens
split unevenly (fixed: a seeded multinomial draw, every expert non-empty). Prints one
table. Run: ``python -m benchmarks.moe`` (``--recipes fp8_current,mxfp8`` for a subset).

On CUDA, quantized recipes run the sync-free grouped path (``moe/grouped_quantized.py``:
``split_quantize_packed`` + ``torch._scaled_grouped_mm`` for E4M3 pairs, the Triton
grouped FP8 kernels of ``kernels/fp8/grouped_gemm`` for pairs with an E5M2 operand (dgrad and
wgrad of fp8_current / fp8_delayed), dequantize-to-bf16 + ``torch._grouped_mm``
otherwise); a recipe it does not serve runs the reference per-expert loop, marked
"(reference loop)". The baseline is the same ``torch._grouped_mm`` calls on bf16
operands, timed in the same run. Target: fp8_current >= 1.3x bf16. The extra row
"fp8_current, E4M3 grads (custom)" shows the step with all three GEMMs on
``torch._scaled_grouped_mm``.
"""

from __future__ import annotations

import argparse

import torch

import hybrid_dist as hd
from benchmarks._bench import bench_ms, print_profile, print_table
from hybrid_dist.moe import GroupedLinear, grouped_quantized
from hybrid_dist.moe._grouped_mm import grouped_mm_linear

E, K, N, T = 8, 7168, 2048, 32768


def fixed_splits(num_experts: int = E, tokens: int = T, seed: int = 0) -> list[int]:
    """Uneven token counts summing to ``tokens``, all > 0: a multinomial draw of the
    tokens over experts with weights in [1, 4) (seeded, on the CPU: the same every run)."""
    g = torch.Generator().manual_seed(seed)
    weights = 1 + 3 * torch.rand(num_experts, generator=g)
    counts = torch.bincount(torch.multinomial(weights, tokens, replacement=True, generator=g),
                            minlength=num_experts)
    splits = [int(c) for c in counts]
    if min(splits) == 0:
        raise AssertionError(f"seed {seed} left an expert empty: {splits}")
    return splits


E4M3_GRADS = "fp8_current, E4M3 grads (custom)"


def _e4m3_grads_recipe():
    """fp8_current with E4M3 gradients: all three grouped GEMMs on ``_scaled_grouped_mm``
    (what E5M2 gradients, dequantized to bf16 for dgrad/wgrad, cost fp8_current)."""
    f = hd.Float8Quantizer()
    return hd.CustomRecipe(lambda role: f, name="fp8_current_e4m3_grads")


def _step(fn, x, w, dy):
    return lambda: torch.autograd.grad(fn(x), [x, w], dy)


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", default=",".join(hd.RECIPE_NAMES), help="comma-separated recipe names")
    p.add_argument("--seed", type=int, default=0, help="seed of the fixed token splits")
    p.add_argument("--no-e4m3-grads", dest="e4m3_grads", action="store_false",
                   help=f"skip the extra row '{E4M3_GRADS}'")
    p.add_argument("--profile", action="store_true", help="print the top kernels of one step per recipe")
    return p.parse_args()


def _torchao_row(x, w, tpe, dy, bf16_ms) -> list:
    """torchao's MoE float8 training GEMM (``torchao.prototype.moe_training``: rowwise FP8 with
    power-of-two scales), or why it cannot run. torchao 0.17 refuses to pad token groups
    itself, so each group is rounded up to 16 rows here (a few dozen more tokens in all)."""
    try:
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm as ao_mm
    except ImportError as e:
        return ["torchao moe_training fp8 rowwise", f"not installed: {e}"[:160], ""]
    counts = (tpe + 15) // 16 * 16
    t = int(counts.sum())
    name = f"torchao moe_training fp8 rowwise (groups padded to 16: T={t})"
    offs = counts.cumsum(0).to(torch.int32)
    xp = torch.randn(t, x.shape[1], device=x.device, dtype=x.dtype).requires_grad_(True)
    dyp = torch.randn(t, dy.shape[1], device=dy.device, dtype=dy.dtype)
    try:
        ms = bench_ms(_step(lambda a: ao_mm(a, w.transpose(-2, -1), offs, pad_token_groups_for_grouped_mm=False),
                            xp, w, dyp))
    except Exception as e:  # keep the table: report the refusal in its row
        return [name, f"failed: {type(e).__name__}: {e}"[:160], ""]
    return [name, ms, bf16_ms / ms]


def main() -> None:
    args = _args()
    splits = fixed_splits(seed=args.seed)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, K, device="cuda", generator=g).bfloat16().requires_grad_(True)
    dy = torch.randn(T, N, device="cuda", generator=g).bfloat16()
    w = (torch.randn(E, N, K, device="cuda", generator=g) / K**0.5).bfloat16().requires_grad_(True)
    tpe = torch.tensor(splits, device="cuda")
    bf16_ms = bench_ms(_step(lambda a: grouped_mm_linear(a, w, tpe), x, w, dy))
    rows = [["bf16 torch._grouped_mm", bf16_ms, 1.0], _torchao_row(x, w, tpe, dy, bf16_ms)]
    names = [r for r in args.recipes.split(",") if r]
    for name in names + ([E4M3_GRADS] if args.e4m3_grads else []):
        recipe = _e4m3_grads_recipe() if name == E4M3_GRADS else hd.recipe_from_name(name)
        try:
            layer = GroupedLinear(E, K, N, recipe=recipe, device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                layer.weight.copy_(w)
            grouped = name == "bf16" or grouped_quantized.fits(layer.plan(recipe), x, layer.weight)
            ms = bench_ms(_step(lambda a: layer(a, tpe), x, layer.weight, dy))
            if args.profile:
                print_profile(_step(lambda a: layer(a, tpe), x, layer.weight, dy), name)
            rows.append([name if grouped else f"{name} (reference loop)", ms, bf16_ms / ms])
        except Exception as e:  # keep the table: report the failure in its row
            rows.append([name, f"failed: {type(e).__name__}: {e}"[:160], ""])
        layer = None
        torch.cuda.empty_cache()
    print_table(["recipe", "fwd+bwd ms", "x bf16"], rows,
                f"GroupedLinear fwd+bwd on {torch.cuda.get_device_name()}: E={E}, K={K}, N={N}, "
                f"T={T}, splits {splits}")


if __name__ == "__main__":
    main()
