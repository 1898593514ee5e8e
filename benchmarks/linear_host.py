"""Where the host time of one ``hd.Linear`` fwd+bwd step goes (cProfile, CUDA).

Prints one table: the functions with the most own (``tottime``) host time per step for
one recipe and shape (default ``fp8_current`` at 8192,2048,2048), after warm-up.
Run: ``python -m benchmarks.linear_host [--recipe NAME] [--shape M,K,N] [--top N]``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import torch

import hybrid_dist as hd
from benchmarks._bench import print_table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="fp8_current")
    p.add_argument("--shape", default="8192,2048,2048")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    m, k, n = (int(v) for v in args.shape.split(","))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    lin = hd.Linear(k, n, bias=False, recipe=hd.recipe_from_name(args.recipe), device="cuda",
                    dtype=torch.bfloat16)

    def step():
        return torch.autograd.grad(lin(x), [x, lin.weight], dy)

    for _ in range(20):
        step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        step()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    total_us = stats.total_tt / args.steps * 1e6
    rows = []
    for (file, line, fn), (cc, nc, tt, ct, _) in sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[: args.top]:
        rows.append([f"{file.split('/')[-1]}:{line}({fn})", nc / args.steps, tt / args.steps * 1e6,
                     ct / args.steps * 1e6])
    print_table(["function", "calls/step", "own us/step", "cum us/step"], rows,
                f"host profile of {args.recipe} fwd+bwd at {m},{k},{n} on {torch.cuda.get_device_name()}: "
                f"{total_us:.0f} us/step under cProfile (inflated by the profiler)")


if __name__ == "__main__":
    main()
