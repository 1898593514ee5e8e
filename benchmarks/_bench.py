"""Shared timing helpers for the benchmarks (median of CUDA-event timings)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def bench_ms(fn, *, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median milliseconds of ``fn()`` (``triton.testing.do_bench``)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def copy_gbps(numel: int = 16384 * 8192, dtype=torch.bfloat16) -> float:
    """Device-to-device copy bandwidth (bytes read + written) in GB/s."""
    src = torch.randn(numel, device="cuda").to(dtype)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / ms / 1e6


def interleaved_ms(fns: dict, rounds: int) -> tuple[dict[object, list[float]], dict[object, str]]:
    """``({key: [ms per round]}, {key: error text})`` for an ordered ``{key: callable}``: each of
    ``rounds`` rounds times every callable once, in order (``bench_ms``), so that a ratio taken
    within a round compares neighbours in time. The GPU's clocks drift over a run by more than
    the differences these benchmarks compare (one H100 run of ``benchmarks.gemm``: bf16 cuBLAS
    at 8192³ read 772 TFLOP/s at its start and 686 at its end). A callable that raises keeps
    its error and leaves the rounds."""
    ms = {key: [] for key in fns}
    errors = {}
    for _ in range(rounds):
        for key, fn in fns.items():
            if key in errors:
                continue
            try:
                ms[key].append(bench_ms(fn))
            except Exception as e:  # keep the table: the caller reports the failure in its row
                errors[key] = f"failed: {type(e).__name__}: {e}"[:160]
    return ms, errors


def host_ms(fn, n: int = 20, warmup: int = 1) -> float:
    """Host (CPU) milliseconds per call: wall time of ``n`` calls enqueued back to back after
    ``warmup`` calls and a sync (few enough calls, or tiny enough work, that the launch queue
    never fills: the GPU must not be the limit)."""
    import time

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) * 1e3 / n
    torch.cuda.synchronize()
    return host


def bytes_equal(a, b) -> bool:
    """Every tensor of ``a`` bitwise equal to its partner in ``b`` (compared as bytes)."""
    return all(torch.equal(p.reshape(-1).view(torch.uint8), q.reshape(-1).view(torch.uint8)) for p, q in zip(a, b))


def print_table(header: list[str], rows: list[list], title: str) -> None:
    """One markdown table."""
    print(f"\n{title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---:" if i else "---" for i in range(len(header))) + "|")
    for r in rows:
        print("| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in r) + " |")


_BLOCKING = ("Synchronize", "Memcpy", "aten::_local_scalar_dense", "aten::item")
_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")


def host_calls(events, per: int = 1) -> tuple[dict[str, float], float]:
    """Per ``per`` steps: the host calls that may block (syncs, memcpys, ``.item()``) by
    name, and the number of kernel launches, from ``prof.key_averages()``."""
    blocking = {e.key: e.count / per for e in events if any(b in e.key for b in _BLOCKING)}
    return blocking, sum(e.count for e in events if e.key in _LAUNCHES) / per


def top_kernels(events, rows: int):
    """GPU kernels by self device time, largest first."""
    kernels = [e for e in events if "CUDA" in str(getattr(e, "device_type", ""))]
    return sorted(kernels, key=lambda e: -e.self_device_time_total)[:rows]


def profile_step(step):
    """``key_averages()`` of one profiled call of ``step`` (after one warm-up call)."""
    step()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        step()
        torch.cuda.synchronize()
    return prof.key_averages()


def print_profile(step, title: str, *, rows: int = 15) -> None:
    """One profiled call of ``step``: GPU kernel time and the top kernels by GPU time."""
    ev = profile_step(step)
    kernels = top_kernels(ev, len(ev))
    total = sum(e.self_device_time_total for e in kernels) / 1e3
    print(f"\n## profile {title}: {total:.2f} ms of kernels, {sum(e.count for e in kernels)} launches")
    for e in kernels[:rows]:
        print(f"  x{e.count:<4d} {e.self_device_time_total / 1e3:8.3f} ms  {e.key[:150]}")


def print_step_profile(step, title: str) -> None:
    """One profiled step (every rank runs it: collectives): GPU kernels and host ops, rank 0 prints."""
    ev = profile_step(step)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    kernels = top_kernels(ev, len(ev))
    gpu_ms = sum(e.self_device_time_total for e in kernels) / 1e3
    host = sorted((e for e in ev if e.self_cpu_time_total > 0), key=lambda e: -e.self_cpu_time_total)
    print(f"\n## profile {title}: {gpu_ms:.2f} ms of kernels, {sum(e.count for e in kernels)} launches, "
          f"{sum(e.self_cpu_time_total for e in host) / 1e3:.2f} ms of host op time")
    for e in kernels[:12]:
        print(f"  gpu x{e.count:<4d} {e.self_device_time_total / 1e3:8.3f} ms  {e.key[:120]}")
    for e in host[:12]:
        print(f"  cpu x{e.count:<4d} {e.self_cpu_time_total / 1e3:8.3f} ms  {e.key[:120]}")
