"""Expert-parallel ``hd.moe.MoE`` fwd+bwd per recipe over an EP group: step time and the
bytes each rank sends to the others per step, with the token payloads quantized before the
all-to-all and in high precision. Prints one table (rank 0).

DeepSeek-V3-like routed experts (hidden 7168, expert FFN 2048, top-4 of 8 experts per
rank), 8192 tokens per rank, no shared expert, bf16 parameters; median of ``--steps``
timed steps after ``--warmup`` (each step: forward, ``y²`` mean + aux loss, backward).
Run on 2-4 GPUs::

    torchrun --nproc_per_node 4 -m benchmarks.moe_ep [--recipes bf16,fp8_current,...]

``time ms`` is the slowest rank's median; ``sent MB`` one rank's bytes to other ranks per
step (dispatch, combine and their gradients, token counts, amax), averaged over ranks;
``× bf16`` both against the bf16 row of the same run. ``dispatch``: ``quantized`` sends
each payload in its consumer's format where the recipe allows it (``moe.expert_parallel``;
otherwise it falls back to high precision, and the bytes show it), ``bf16`` exchanges high
precision and quantizes after (bitwise the same result: ``tests_distributed/test_moe_ep.py``).
``--dx-exchange early,after`` times each row twice: the dispatch's backward all-to-all
started inside fc1's backward, during its wgrad (``early``, the layer's default), and
after it (``after``: the dispatch column says ``dx after``).
On CPU (gloo) it runs too, for the smoke test (``--tiny``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import torch
import torch.distributed as dist

import hybrid_dist as hd
from benchmarks._bench import print_step_profile, print_table
from hybrid_dist.moe import MoE


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden: int = 7168
    ffn: int = 2048
    experts_per_rank: int = 8
    top_k: int = 4
    tokens: int = 8192  # per rank


TINY = Shape(hidden=64, ffn=64, experts_per_rank=2, top_k=2, tokens=32)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_recipe(recipe_name, quantized, shape, device, steps, warmup, group, profile=False, early=True):
    """(median step seconds on this rank, bytes sent per step) for one recipe and dispatch;
    ``early``: the layer's ``early_input_grad``."""
    world = dist.get_world_size(group)
    recipe = None if recipe_name == "bf16" else hd.recipe_from_name(recipe_name)
    torch.manual_seed(0)
    moe = MoE(shape.hidden, shape.ffn, shape.experts_per_rank * world, shape.top_k, recipe=recipe, ep_group=group,
              quantized_dispatch=quantized, early_input_grad=early, name="moe", device=device, dtype=torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(1 + dist.get_rank(group))
    x = torch.randn(shape.tokens, shape.hidden, device=device, dtype=torch.bfloat16, generator=gen)
    def step():
        y, aux = moe(x)
        (y.float().square().mean() + aux).backward()
        moe.zero_grad(set_to_none=True)

    times = []
    for i in range(warmup + steps):
        if i == warmup:
            moe.wire.bytes.clear()
        dist.barrier(group)
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    sent = sum(moe.wire.bytes.values()) / steps
    if profile:
        print_step_profile(step, f"{recipe_name}, {'quantized' if quantized else 'bf16'} dispatch")
    return statistics.median(times[warmup:]), sent


def run_ep(rank: int, world: int, recipes: list[str], shape: Shape = Shape(), steps: int = 8,
           warmup: int = 3, profile: bool = False, dx_exchange: tuple[str, ...] = ("early",)) -> list[list]:
    """Table rows (the same on every rank): recipe, dispatch, time ms, × bf16, sent MB, × bf16
    (the first bf16 row); one row per ``dx_exchange`` mode (``early``, ``after``) each."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    group = dist.group.WORLD
    results = []
    for name in recipes:
        for quantized in ((False,) if name == "bf16" else (True, False)):
            for mode in dx_exchange:
                sec, sent = _time_recipe(name, quantized, shape, device, steps, warmup, group, profile,
                                         early=mode == "early")
                t = torch.tensor([sec, sent], dtype=torch.float64, device=device)
                slowest, total = t.clone(), t.clone()
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
                dist.all_reduce(total, group=group)
                label = ("quantized" if quantized else "bf16") + ("" if mode == "early" else ", dx after")
                results.append((name, label, slowest[0].item() * 1e3, total[1].item() / world / 1e6))
    base = next(((ms, mb) for n, _, ms, mb in results if n == "bf16"), None)
    return [[n, d, ms, base[0] / ms if base else "", mb, mb / base[1] if base and base[1] else ""]
            for n, d, ms, mb in results]  # one rank sends nothing: no bytes ratio


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", default="bf16,fp8_current,fp8_delayed,mxfp8,mxfp8_fwd_nvfp4_bwd",
                   help="comma-separated recipe names (bf16 first: the baseline)")
    p.add_argument("--tokens", type=int, default=Shape.tokens, help="tokens per rank")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--profile", action="store_true",
                   help="after timing, profile one step per row: top GPU kernels and host ops (CUDA)")
    p.add_argument("--dx-exchange", default="early",
                   help="comma-separated: early (dx's all-to-all during fc1's wgrad), after (module doc)")
    args = p.parse_args()
    modes = tuple(args.dx_exchange.split(","))
    if not modes or set(modes) - {"early", "after"}:
        p.error(f"--dx-exchange takes early and/or after, got {args.dx_exchange!r}")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    shape = TINY if args.tiny else dataclasses.replace(Shape(), tokens=args.tokens)
    rows = run_ep(dist.get_rank(), dist.get_world_size(), args.recipes.split(","), shape, args.steps, args.warmup,
                  args.profile and cuda, modes)
    if dist.get_rank() == 0:
        dev = torch.cuda.get_device_name() if cuda else "CPU (gloo)"
        print_table(["recipe", "dispatch", "time ms", "x bf16", "sent MB", "x bf16 bytes"], rows,
                    f"MoE EP={dist.get_world_size()} fwd+bwd, {shape}, on {dev}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
