"""TP+SP transformer MLP block (``fc1`` column-parallel, GELU, ``fc2`` row-parallel, both
sequence parallel): fwd+bwd step time and bytes on the wire per step, per recipe, with
quantized all-gathers (path b) against high-precision all-gathers (gather bf16, then
quantize). Gradient reduce-scatters are bf16 in both. Prints one table on rank 0.

Run on 2–4 GPUs of one host: ``torchrun --nproc_per_node=4 -m benchmarks.tp``
(``--seq``, ``--hidden``, ``--ffn`` change the shape; activations are ``[S/tp, 1, H]``;
``--device cpu`` runs a gloo smoke test of the script itself, timings meaningless;
``--profile fp8_current`` prints one profiled step per path: top GPU kernels and host ops;
``--compile`` compiles the block, whose collectives are then functional collectives;
``--rounds N`` times the two paths in turn N times, for a ratio that host and clock drift
within a run do not decide).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

import hybrid_dist as hd
from benchmarks._bench import print_step_profile, print_table
from hybrid_dist.tensor_parallel import HybridColwiseParallel, HybridRowwiseParallel, record_wire_bytes

RECIPES = ["bf16", "fp8_current", "fp8_delayed", "fp8_block", "mxfp8", "nvfp4", "mxfp8_fwd_nvfp4_bwd",
           "fp8_fwd_bf16_bwd", "bf16_fwd_mxfp8_bwd"]


class MLP(nn.Module):
    def __init__(self, h: int, f: int, recipe, device):
        super().__init__()
        self.fc1 = hd.Linear(h, f, bias=False, recipe=recipe, name="fc1", device=device, dtype=torch.bfloat16)
        self.fc2 = hd.Linear(f, h, bias=False, recipe=recipe, name="fc2", device=device, dtype=torch.bfloat16)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _step(model, x, dy):
    params = [p for p in model.parameters() if p.requires_grad]
    return lambda: torch.autograd.grad(model(x), [x, *params], dy)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time_ms(fn, device: str, *, warmup: int = 3, iters: int = 10) -> float:
    """Median step time over ``iters`` (max over ranks: the slowest rank sets the pace)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        _sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    t = torch.tensor(statistics.median(times), device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _build(recipe_name, mesh, args, quantized: bool):
    """``(step, wire log of one eager step)`` of one path (compiled with ``args.compile``)."""
    torch.manual_seed(0)
    model = MLP(args.hidden, args.ffn, hd.recipe_from_name(recipe_name), args.device)
    parallelize_module(model, mesh, {
        "fc1": HybridColwiseParallel(sequence_parallel=True, quantized_gather=quantized),
        "fc2": HybridRowwiseParallel(sequence_parallel=True, quantized_gather=quantized)})
    tp = mesh.size()
    x = torch.randn(args.seq // tp, 1, args.hidden, device=args.device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    with record_wire_bytes() as log:  # bytes of an eager step (compiled code logs nothing)
        _step(model, x, dy)()
    return _step(torch.compile(model, fullgraph=True) if args.compile else model, x, dy), log


def _ratio(ratios: list[float]) -> str:
    mid = statistics.median(ratios)
    return f"{mid:.3f}" if len(ratios) == 1 else f"{mid:.3f} [{min(ratios):.3f}, {max(ratios):.3f}]"


def table_rows(recipes: list[str], mesh, args) -> list[list]:
    """One row per recipe: step ms with bf16 and with quantized gathers (medians over
    ``args.rounds`` rounds, each timing both paths in turn), the median of the per-round
    ratios [min, max], and the MiB each rank gathers (both paths) and reduce-scatters per
    step. ``args``: ``seq``, ``hidden``, ``ffn``, ``iters``, ``rounds``, ``device``,
    ``profile`` (a set of recipe names), ``compile``."""
    rows = []
    for name in recipes:
        try:
            paths = {quantized: _build(name, mesh, args, quantized) for quantized in (False, True)}
            ms = {False: [], True: []}
            for _ in range(getattr(args, "rounds", 1)):
                for quantized, (step, _) in paths.items():
                    ms[quantized].append(_time_ms(step, args.device, iters=args.iters))
            if name in args.profile and args.device == "cuda":
                for quantized, (step, _) in paths.items():
                    print_step_profile(step, f"{name}, {'quantized' if quantized else 'bf16'} gathers")
        except Exception as e:  # keep the table: report the failure in its row (traceback on stderr)
            traceback.print_exc()
            rows.append([name, f"failed: {type(e).__name__}: {e}"[:100], "", "", "", "", ""])
            continue
        mb = 1 / 2**20
        hp_log, q_log = paths[False][1], paths[True][1]
        rows.append([name, statistics.median(ms[False]), statistics.median(ms[True]),
                     _ratio([a / b for a, b in zip(ms[False], ms[True])]), hp_log.total("all_gather") * mb,
                     q_log.total("all_gather") * mb, q_log.total("reduce_scatter") * mb])
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--rounds", type=int, default=1, help="time both paths in turn this many times; ratios are "
                   "medians of the per-round ratios [min, max]")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated recipe names")
    p.add_argument("--compile", action="store_true", help="torch.compile the MLP (fullgraph) in both paths")
    p.add_argument("--profile", default="", help="recipes (comma-separated) whose steps are profiled once: "
                   "top GPU kernels and host ops of each path, on rank 0")
    args = p.parse_args()
    args.profile = set(filter(None, args.profile.split(",")))
    if args.compile:  # both paths of every recipe stay compiled (one cache entry per model)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(RECIPES))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group("gloo")
    mesh = init_device_mesh(args.device, (dist.get_world_size(),), mesh_dim_names=("tp",))["tp"]
    rows = table_rows(args.recipes.split(","), mesh, args)
    if dist.get_rank() == 0:
        tp = dist.get_world_size()
        print_table(
            ["recipe", "step ms (bf16 gathers)", "step ms (quantized gathers)", "speedup",
             "all-gather MiB/step (bf16)", "all-gather MiB/step (quantized)", "reduce-scatter MiB/step"],
            rows,
            f"TP={tp}+SP MLP block fwd+bwd{' (compiled)' if args.compile else ''}, S={args.seq}, H={args.hidden}, "
            f"F={args.ffn}, bf16 activations "
            f"(bytes = gathered output per rank)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
