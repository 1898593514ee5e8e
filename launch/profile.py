"""``--profile-step N [--profile-steps K]``: the torch profiler around training steps N to
N+K-1 on rank 0, its summary printed (wall and kernel time, host time of the launcher's and
FSDP2's regions, top kernels and host ops) and, with ``--profile-trace F``, its Chrome trace
(gzipped for ``.gz``; ``python -m benchmarks.trace_summary F`` reads it). The device is
waited for before the first profiled step and after the last only, so with K > 1 the later
steps show the steady state, where the host runs ahead of the device. Profiled steps run
slower than unprofiled ones, op-heavy host code most: compare configurations with each
other; the step records' ``host_s`` time the host without a profiler."""

from __future__ import annotations

import contextlib
import time

import torch


class StepProfiler:
    """``with prof.around(step):`` around each training step: profiles steps ``first`` to
    ``first + count - 1`` on rank 0 as one trace and prints its summary after the last.
    ``host=False``: device activity only (on CUDA), no host ops."""

    def __init__(self, first: int, count: int, *, rank: int, trace: str | None = None, host: bool = True):
        self.first, self.last, self.rank, self.trace, self.host = first, first + count - 1, rank, trace, host
        self._prof = None
        self._t0 = 0.0

    def profiles(self, step: int) -> bool:
        return self.first > 0 and self.first <= step <= self.last

    @contextlib.contextmanager
    def around(self, step: int):
        if self.rank != 0 or not self.profiles(step):
            yield
            return
        if step == self.first:
            acts = [torch.profiler.ProfilerActivity.CPU] if self.host or not torch.cuda.is_available() else []
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
                torch.cuda.synchronize()
            self._t0 = time.perf_counter()
            self._prof = torch.profiler.profile(activities=acts)
            self._prof.__enter__()
        try:
            yield
        finally:
            if step == self.last:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                prof, self._prof = self._prof, None
                prof.__exit__(None, None, None)
                _report(prof, time.perf_counter() - self._t0, self.last - self.first + 1, self.trace)


def _report(prof, wall: float, steps: int, trace: str | None) -> None:
    if trace:
        _export_trace(prof, trace)
    ev = prof.key_averages()
    kernels = sorted((e for e in ev if e.self_device_time_total > 0 and e.device_type.name == "CUDA"),
                     key=lambda e: -e.self_device_time_total)
    gpu = sum(e.self_device_time_total for e in kernels) / 1e3
    print(f"profile: {steps} step(s), wall {wall * 1e3:.1f} ms, kernels {gpu:.1f} ms (all streams), "
          f"{sum(e.count for e in kernels)} launches", flush=True)
    regions: dict[str, list[float]] = {}  # FSDP's per-module labels summed over modules
    for e in ev:
        if e.key.startswith(("hd::", "FSDP::")):
            r = regions.setdefault(e.key.split(" (")[0], [0, 0.0])
            r[0] += e.count
            r[1] += e.cpu_time_total / 1e3
    for key, (count, ms) in regions.items():
        print(f"  host {key:<40s} x{count:<4d} {ms:9.2f} ms", flush=True)
    for e in kernels[:25]:
        print(f"  gpu  x{e.count:<5d} {e.self_device_time_total / 1e3:8.2f} ms  {e.key[:120]}", flush=True)
    ops = sorted((e for e in ev if e.self_cpu_time_total > 0 and not e.key.startswith(("hd::", "FSDP::"))),
                 key=lambda e: -e.self_cpu_time_total)
    for e in ops[:20]:  # where the host's own time went (profiler overhead included)
        print(f"  cpu  x{e.count:<5d} {e.self_cpu_time_total / 1e3:8.2f} ms  {e.key[:120]}", flush=True)


def _export_trace(prof, path: str) -> None:
    if not path.endswith(".gz"):
        prof.export_chrome_trace(path)
        return
    import gzip
    import shutil
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        prof.export_chrome_trace(tmp.name)
        with open(tmp.name, "rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)


__all__ = ["StepProfiler"]
