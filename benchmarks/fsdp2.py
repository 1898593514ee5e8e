"""FSDP2 training step of a Llama-3-8B-shaped stack per recipe: step time, peak memory and
all-gather bytes per step. Prints one table (rank 0).

8 blocks (hidden 4096, FFN 14336, 32 heads, 8 KV heads, RMSNorm, SwiGLU, SDPA), no
embedding or head; batch 1 × seq 4096 per GPU (`--seq`); each block its own FSDP2 group
(``reshard_after_forward=True``), bf16 parameters (quantized ones built under
``hd.quantized_model_init``), ``hd.MasterWeightOptimizer(AdamW)`` (fused, torchtitan's
default; ``--adam foreach`` for the multi-tensor form the earlier tables used); median of 8 timed steps
after 4 warm-up steps. ``peak GiB``: the run's peak allocation above what was allocated before
its model was built (earlier recipes' models stay alive). ``host ms``: the host's time from the step's start until it has
enqueued the whole step (before the closing synchronize): the step is host-bound where it
approaches ``step ms``. Run on 4 GPUs::

    torchrun --nproc_per_node 4 -m benchmarks.fsdp2 [--recipes bf16,fp8_current,...]

All-gather bytes: the quantized parameters' bytes from ``hybrid_dist.fsdp2.track_all_gather``
(output bytes on this rank) plus, for high-precision parameters (norm weights, and every
linear weight under ``bf16``), their bf16 bytes per all-gather.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import hybrid_dist as hd
from benchmarks._bench import host_calls, print_table, top_kernels
from hybrid_dist.fsdp2 import track_all_gather

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, SEQ = 4096, 14336, 32, 8, 8, 4096
RECIPES = ("bf16", "fp8_current", "mxfp8_fwd_nvfp4_bwd", "nvfp4")


class Block(nn.Module):
    """Pre-norm attention + SwiGLU MLP; shapes: x_BTD (B batch, T tokens, D hidden)."""

    def __init__(self, device):
        super().__init__()
        hd_dim = HIDDEN // HEADS
        lin = lambda i, o: hd.Linear(i, o, bias=False, device=device, dtype=torch.bfloat16)  # noqa: E731
        self.attn_norm = nn.RMSNorm(HIDDEN, device=device, dtype=torch.bfloat16)
        self.q, self.k, self.v = lin(HIDDEN, HIDDEN), lin(HIDDEN, KV_HEADS * hd_dim), lin(HIDDEN, KV_HEADS * hd_dim)
        self.o = lin(HIDDEN, HIDDEN)
        self.mlp_norm = nn.RMSNorm(HIDDEN, device=device, dtype=torch.bfloat16)
        self.gate, self.up, self.down = lin(HIDDEN, FFN), lin(HIDDEN, FFN), lin(FFN, HIDDEN)

    def forward(self, x_BTD):
        b, t, _ = x_BTD.shape
        h = self.attn_norm(x_BTD)
        q = self.q(h).view(b, t, HEADS, -1).transpose(1, 2)
        k = self.k(h).view(b, t, KV_HEADS, -1).transpose(1, 2)
        v = self.v(h).view(b, t, KV_HEADS, -1).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x_BTD = x_BTD + self.o(a.transpose(1, 2).reshape(b, t, HIDDEN))
        h = self.mlp_norm(x_BTD)
        return x_BTD + self.down(F.silu(self.gate(h)) * self.up(h))


def build(recipe_name: str, device) -> nn.Sequential:
    recipe = hd.recipe_from_name(recipe_name)
    torch.manual_seed(0)
    if recipe_name == "bf16":
        return nn.Sequential(*[Block(device) for _ in range(LAYERS)])
    with hd.quantized_model_init(recipe, keep_high_precision_init=False):
        return nn.Sequential(*[Block(device) for _ in range(LAYERS)])


def hp_forward_gather_bytes(model: nn.Module) -> int:
    """bf16 bytes one forward all-gathers for parameters without quantized all-gather
    (backward re-gathers the same after the forward reshard)."""
    return sum(p.numel() * 2 for p in model.parameters()
               if not isinstance(getattr(p, "_local_tensor", p), hd.QuantizedTensor))


def _step(model, opt, recipe, x) -> None:
    with hd.autocast(recipe):
        model(x).float().square().mean().backward()
    opt.step()
    opt.zero_grad()


def _profile_step(name: str, step) -> None:
    """One profiled step: host enqueue time, GPU kernel time, top kernels (``--profile``)."""
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts, record_shapes=True, with_stack=False) as prof:
        t0 = time.perf_counter()
        step()
        host = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
    ev = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in ev) / 1e3
    print(f"\n## profile {name}: host enqueue {host:.1f} ms, GPU kernel time {gpu:.1f} ms (all streams)")
    print(ev.table(sort_by="self_device_time_total", row_limit=22, max_name_column_width=70))
    copies = ("aten::copy_", "aten::to", "aten::_to_copy", "aten::clone", "aten::contiguous")
    by_shape = [e for e in prof.key_averages(group_by_input_shape=True) if e.key in copies]
    by_shape.sort(key=lambda e: -e.device_time_total)
    for e in by_shape[:12]:
        print(f"  {e.key} x{e.count} {e.device_time_total / 1e3:.2f} ms  shapes {e.input_shapes}")
    for e in top_kernels(ev, 12):
        print(f"  kernel x{e.count} {e.self_device_time_total / 1e3:.2f} ms  {e.key[:200]}")
    blocking, launches = host_calls(ev)
    print(f"  blocking calls {blocking}; kernel launches {launches:.0f}")
    print(ev.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70))
    import cProfile
    import io
    import pstats
    pr = cProfile.Profile()
    pr.enable()
    step()
    pr.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("cumulative").print_stats(r"hybrid_dist|fsdp2|_fsdp|optim", 35)
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(30)
    print(out.getvalue())


def run(recipe_name: str, device, warmup: int, steps: int, profile: bool = False,
        compile_blocks: bool = False, seq: int = SEQ, adam: str = "fused") -> list:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # FSDP2 keeps every module it wrapped alive (torch's global module-state map), so the
    # models of earlier recipes stay allocated: peak memory is counted above this baseline
    base = torch.cuda.memory_allocated()
    model = build(recipe_name, device)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model:
        if compile_blocks:  # per block, as torchtitan: FSDP2's hooks stay outside the graphs
            block.compile()
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = hd.MasterWeightOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-5, **{adam: True})
    recipe = hd.recipe_from_name(recipe_name)
    x = torch.randn(1, seq, HIDDEN, device=device, dtype=torch.bfloat16)
    times, host_times, acct = [], [], None
    torch.cuda.reset_peak_memory_stats()
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with track_all_gather() as a, hd.autocast(recipe):
            model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        t_host = time.perf_counter()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
            host_times.append((t_host - t0) * 1e3)
            acct = a
    ms, host_ms = statistics.median(times), statistics.median(host_times)
    if profile:  # every rank runs the step (matching collectives); rank 0 profiles it
        # model/opt bound as defaults: ruff otherwise sees them as unbound through the later `del model, opt`
        step = lambda model=model, opt=opt: _step(model, opt, recipe, x)  # noqa: E731
        _profile_step(recipe_name, step) if dist.get_rank() == 0 else (step(), step())
    hp = hp_forward_gather_bytes(model)
    fwd = acct.output_bytes.get("forward", 0) + acct.output_bytes.get("forward_both", 0) + hp
    total = acct.total_output_bytes() + 2 * hp
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    del model, opt
    torch.cuda.empty_cache()
    return [recipe_name + (" (compiled)" if compile_blocks else ""), ms, host_ms, seq / ms * 1e3, peak,
            fwd / 2**20, total / 2**20]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--profile", action="store_true", help="rank 0 prints one profiled step per recipe")
    ap.add_argument("--compile", action="store_true", help="torch.compile each block (before fully_shard)")
    ap.add_argument("--seq", type=int, default=SEQ, help="tokens per GPU (batch 1)")
    ap.add_argument("--adam", choices=("fused", "foreach"), default="fused", help="AdamW implementation")
    ap.add_argument("--copy-in", choices=("torch", "hd"), default="torch",
                    help="FSDP2's gradient copy-in: its own, or the launcher's --fsdp-copy-in hd")
    args = ap.parse_args()
    from hybrid_dist.launch import fsdp_copy_in

    fsdp_copy_in.choose(args.copy_in)  # the launcher's --fsdp-copy-in (hd raises where torch does not allow it)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    rows = [run(name, device, args.warmup, args.steps, args.profile, args.compile, args.seq, args.adam)
            for name in args.recipes.split(",")]
    if rank == 0:
        base = {r[0]: r for r in rows}.get("bf16" + (" (compiled)" if args.compile else ""))
        out = []
        for r in rows:
            ratio = (r[1] and base[1] / r[1]) if base else float("nan")
            host_ratio = r[2] / base[2] if base else float("nan")
            fwd_ratio = (r[5] / base[5]) if base and base[5] else float("nan")
            out.append([*r[:3], host_ratio, *r[3:5], ratio, r[5], fwd_ratio, r[6]])
        print_table(
            ["recipe", "step ms", "host ms", "host × bf16", "tokens/s/GPU", "peak GiB", "× bf16 speed",
             "fwd all-gather MiB", "fwd AG × bf16", "all-gather MiB/step"],
            out,
            f"FSDP2 Llama-3-8B-shaped {LAYERS}-layer stack, {dist.get_world_size()} GPUs, seq {args.seq}, "
            f"{args.adam} AdamW, copy-in {args.copy_in}",
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
