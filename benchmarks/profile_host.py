"""Where the host time of an ``hd.Linear`` fwd+bwd step goes, on one GPU.

For each recipe at one shape: the CUDA runtime calls that block the host (synchronizes,
device-to-host copies) per step, then the Python functions by own time (cProfile) and the
torch ops by self CPU time (torch.profiler). Run:
``python -m benchmarks.profile_host --shape 8192,2048,2048 --recipes fp8_current,fp8_delayed``
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch
from torch import nn

import hybrid_dist as hd
from benchmarks._bench import host_calls



def _step(module, x, dy):
    params = [p for p in module.parameters() if p.requires_grad]
    return lambda: torch.autograd.grad(module(x), [x, *params], dy)


def profile(name: str, m: int, k: int, n: int, steps: int = 10) -> None:
    x = torch.randn(m, k, device="cuda").bfloat16().requires_grad_(True)
    dy = torch.randn(m, n, device="cuda").bfloat16()
    mod = (nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16) if name == "bf16"
           else hd.Linear(k, n, bias=False, recipe=hd.recipe_from_name(name), device="cuda", dtype=torch.bfloat16))
    step = _step(mod, x, dy)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    blocking, launches = host_calls(events, per=steps)
    print(f"\n## {name} {m},{k},{n}: blocking calls per step {blocking}; kernel launches per step {launches:.1f}")
    print(events.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        step()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
    print(s.getvalue())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="8192,2048,2048")
    p.add_argument("--recipes", default="bf16,fp8_current,fp8_delayed")
    args = p.parse_args()
    m, k, n = (int(v) for v in args.shape.split(","))
    for name in args.recipes.split(","):
        profile(name, m, k, n)


if __name__ == "__main__":
    main()
