"""Progress line, metrics JSONL and the final summary (rank 0 prints and writes).

MFU = achieved model FLOP/s ÷ the device's dense **bf16** peak (whatever the recipe), with
FLOPs per token from ``ModelConfig.flops_per_token``; unknown devices (and CPUs) report
none. Peak memory is ``torch.cuda.max_memory_allocated`` since the meter started (the
training steps, not the model build) on GPU and the process's peak RSS on CPU. Step times
leave out the synthetic batch generation (``data_time_s``: host work while the device
idles, up to ~0.1 s per 4k-token sequence). All-gather bytes are per rank per step:
measured by ``hybrid_dist.fsdp2`` when it exposes accounting, else estimated from the
sharded parameters (``ag_bytes_est``). With quantized parameters ``ag_bytes`` = measured
quantized gathers + the high-precision parameters' unsharded bytes.
"""

from __future__ import annotations

import fcntl
import json
import os
import resource
import sys
import time

import torch

# Dense bf16 tensor-core peak, FLOP/s (vendor datasheets, SXM parts).
_BF16_PEAK = {"H100": 989e12, "H200": 989e12, "B200": 2250e12, "A100": 312e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in _BF16_PEAK.items() if k in name), None)


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def allocator_stats(device: torch.device) -> dict | None:
    """The CUDA caching allocator's peak reserved bytes, its cudaMalloc calls and its retries
    (an allocation that found no cached block and no free device memory: the allocator
    synchronizes the device, frees its cache and tries again, which stalls the host's run-ahead)."""
    if device.type != "cuda":
        return None
    st = torch.cuda.memory_stats(device)
    return {"peak_reserved_bytes": st.get("reserved_bytes.all.peak", 0), "alloc_retries": st.get("num_alloc_retries", 0),
            "device_mallocs": st.get("num_device_alloc", 0)}


def timed_steps(steps: list[dict], warmup: int) -> list[dict]:
    """The step records that count for throughput: all but the first ``warmup`` (allocator
    warm-up, Triton JIT, torch.compile), and at least the last one."""
    return steps[warmup:] or steps[-1:]


def timed_tokens_per_s(steps: list[dict], warmup: int) -> float:
    """Tokens / wall time over ``timed_steps`` (not a mean of per-step rates)."""
    timed = timed_steps(steps, warmup)
    tokens = sum(r.get("tokens", r["tokens_per_s"] * r["step_time_s"]) for r in timed)
    return tokens / max(sum(r["step_time_s"] for r in timed), 1e-12)


def mean_host_ms(steps: list[dict]) -> dict | None:
    """Mean host time (ms) per step issuing each region (``host_s`` of the step records), or
    None when the records have none. Next to the step time it shows whether the host
    bounds the step: a step cannot be shorter than the host's time issuing it."""
    hosts = [r["host_s"] for r in steps if r.get("host_s")]
    if not hosts:
        return None
    return {k: 1e3 * sum(h[k] for h in hosts) / len(hosts) for k in hosts[0]}


def _clock(seconds: float) -> str:
    """``m:ss``, or ``h:mm:ss`` from an hour."""
    m, sec = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


class Meter:
    """``meter.steps([...])`` with the steps run since the last call, or ``meter.step(...)``
    after each optimizer step (on every rank)."""

    def __init__(self, *, total_steps: int, flops_per_token: int, world_size: int, device: torch.device,
                 rank: int, jsonl_path: str | None, log_every: int, quiet: bool, run: dict,
                 ag_bytes_per_step: int | None, ag_measured: bool, timing_warmup: int = 2):
        self.total, self.flops_per_token, self.world = total_steps, flops_per_token, world_size
        self.device, self.is_main, self.log_every, self.quiet = device, rank == 0, log_every, quiet
        self.peak = peak_flops(device)
        self.timing_warmup = timing_warmup
        self.ag_key = "ag_bytes" if ag_measured else "ag_bytes_est"
        self.ag_bytes = ag_bytes_per_step  # measured runs set it before each step()
        self.records: list[dict] = []
        self._file = None
        if jsonl_path and self.is_main:
            os.makedirs(os.path.dirname(os.path.abspath(jsonl_path)), exist_ok=True)
            self._file = open(jsonl_path, "a")  # appended: plot reads the last fresh run
            try:  # one writer per file: two jobs' lines would interleave (released at close or exit)
                fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._file.close()
                raise ValueError(f"--metrics {jsonl_path}: another job is writing this file; give each job its "
                                 "own metrics path") from None
        if device.type == "cuda":  # peak of training, not of building (a quantized init is unsharded first)
            torch.cuda.reset_peak_memory_stats(device)
        self._t0 = self._t_last = time.perf_counter()
        self._excluded = 0.0
        self._tokens_total = 0
        self._emit({"event": "start", **run})

    def _emit(self, rec: dict) -> None:
        if self._file:
            self._file.write(json.dumps(rec) + "\n")
            self._file.flush()

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` (host-side batch generation, while the device idles) out of this
        step's time; the step record shows them as ``data_time_s``."""
        self._excluded += seconds

    def inspect(self, step: int, records: list[dict]) -> None:
        """One ``inspect`` line: the quantization statistics of ``step`` (``launch.inspect_stats``)."""
        self._emit({"event": "inspect", "step": step, "rank": 0, "records": records})

    def step(self, step: int, loss: float, tokens: int, lr: float) -> dict:
        """``tokens``: tokens processed by all ranks in this step."""
        return self.steps([{"step": step, "loss": loss, "tokens": tokens, "lr": lr, "ag_bytes": self.ag_bytes}])[-1]

    def steps(self, window: list[dict]) -> list[dict]:
        """Records of the steps run since the last call, each ``{"step", "loss", "tokens",
        "lr", "ag_bytes"}`` and optionally ``"grad_norm"`` and ``"host_s"`` (the host's time
        issuing forward / backward / optimizer): one device sync for all of them, and the
        window's wall time shared equally (the training loop reads results back only every
        few steps, so that the host can queue the next step while the device finishes this
        one)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        data_s, self._excluded = self._excluded, 0.0
        dt, self._t_last = max(now - self._t_last - data_s, 1e-9) / len(window), now
        out = []
        for w in window:
            self._tokens_total += w["tokens"]
            tps = w["tokens"] / dt
            mfu = (tps * self.flops_per_token / (self.world * self.peak)) if self.peak else None
            rec = {"event": "step", "step": w["step"], "loss": w["loss"], "lr": w["lr"], "tokens": w["tokens"],
                   "tokens_per_s": tps, "step_time_s": dt, "data_time_s": data_s / len(window), "mfu": mfu,
                   "peak_mem_bytes": peak_memory_bytes(self.device), self.ag_key: w["ag_bytes"]}
            for k in ("grad_norm", "host_s"):
                if w.get(k) is not None:
                    rec[k] = w[k]
            self.records.append(rec)
            self._emit(rec)
            out.append(rec)
        last = out[-1]
        if self.is_main and not self.quiet and (last["step"] % self.log_every == 0 or last["step"] == self.total):
            print(self._progress_line(last["step"], last["loss"], last["tokens_per_s"], last["mfu"], last, now),
                  flush=True)
        return out

    def _progress_line(self, step: int, loss: float, tps: float, mfu: float | None, rec: dict, now: float) -> str:
        """One line of at most 100 columns (up to 99,999 steps): step, loss, tokens/s, MFU,
        peak memory and all-gather bytes per step in GiB (``~`` estimated), elapsed<remaining."""
        mfu_s = f"{100 * mfu:4.1f}%" if mfu is not None else "n/a"
        ag = ""
        if self.ag_bytes is not None:
            ag = f" AG {rec[self.ag_key] / 2**30:.1f}G{'' if self.ag_key == 'ag_bytes' else '~'}"
        elapsed = now - self._t0
        left = elapsed / max(len(self.records), 1) * (self.total - step)
        return (f"step {step:>5}/{self.total}  loss {loss:7.4f}  {tps:>9,.0f} tok/s  MFU {mfu_s}  "
                f"mem {rec['peak_mem_bytes'] / 2**30:.1f}G{ag}  {_clock(elapsed)}<{_clock(left)}")

    def finish(self, extra: dict) -> dict:
        steps = self.records
        # the first steps include allocator warm-up, Triton JIT and torch.compile: leave them
        # out (keep at least the last step); tokens/s = timed tokens / timed wall time
        timed = timed_steps(steps, self.timing_warmup)
        tps = timed_tokens_per_s(steps, self.timing_warmup)
        summary = {"event": "summary", "steps": len(steps), "first_loss": steps[0]["loss"] if steps else None,
                   "final_loss": steps[-1]["loss"] if steps else None, "tokens_per_s": tps,
                   "timed_steps": [r["step"] for r in timed],
                   "mfu": (tps * self.flops_per_token / (self.world * self.peak)) if self.peak else None,
                   "peak_mem_bytes": peak_memory_bytes(self.device), "allocator": allocator_stats(self.device),
                   "host_ms": mean_host_ms(timed), "wall_s": time.perf_counter() - self._t0, **extra}
        self._emit(summary)
        if self._file:
            self._file.close()
        if self.is_main and not self.quiet:
            print(format_summary(summary), file=sys.stdout, flush=True)
        return summary


def format_summary(s: dict) -> str:
    mfu = f"{100 * s['mfu']:.1f}%" if s.get("mfu") is not None else "n/a (no known GPU peak)"
    floor = s.get("entropy_floor")
    ref = f" (data entropy floor {floor:.3f}, untrained log(vocab) {s['log_vocab']:.3f})" \
        if isinstance(floor, float) and floor == floor else ""
    first, final = s["first_loss"], s["final_loss"]
    loss = f"loss {first:.4f} -> {final:.4f}{ref}" if first is not None else "no steps run"
    cs = s.get("compile_stats")
    compiled = f"; compiled {cs['graphs']} graphs, {cs['graph_breaks']} graph breaks" if cs else ""
    h = s.get("host_ms")
    host = f"; host ms/step fwd {h['forward']:.0f}, bwd {h['backward']:.0f}, opt {h['optimizer']:.0f}" if h else ""
    a = s.get("allocator")
    alloc = (f" (reserved {a['peak_reserved_bytes'] / 2**30:.2f}, {a['device_mallocs']} cudaMalloc, "
             f"{a['alloc_retries']} retries)") if a else ""
    return (f"summary: {s['steps']} steps, {loss}; {s['tokens_per_s']:,.0f} tok/s, MFU {mfu}, "
            f"peak mem {s['peak_mem_bytes'] / 2**30:.2f} GiB{alloc}, {s['wall_s']:.1f} s{compiled}{host}")
