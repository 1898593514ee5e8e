"""Where one profiled training step's GPU time goes, from its Chrome trace
(``launch.train --profile-step N [--profile-steps K] --profile-trace step.json.gz``).

Per trace (and, for several steps, the last step alone): the GPU window, each stream's busy
time (union of its kernels and copies), the compute stream's idle time per launcher region
(``hd::forward`` / ``backward`` / ``optimizer``), its longest idle gaps, and kernel time by
category.
Compare traces of different configurations taken on the same machine.
Run: ``python -m benchmarks.trace_summary a.json.gz b.json.gz [--gaps 8]``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re

CATEGORIES = (  # first match wins
    ("nccl", r"nccl"),
    ("attention", r"sdpa|flash|fmha|attention"),
    ("gemm", r"nvjet|gemm|cutlass|xmma|sm90_|_scaled_mm|matmul"),
    ("quantize", r"cast_transpose|amax|quantiz|_transpose_kernel|fp8|float8|mxfp|nvfp4|e2m1|scale"),
    ("optimizer", r"multi_tensor_apply|FusedOptimizer|adam"),
    ("norm/act (fused)", r"^triton_"),
    ("copy", r"copy|cat|split|Memcpy|Memset|fill"),
)
REGIONS = ("hd::forward", "hd::backward", "hd::optimizer")


def category(name: str) -> str:
    for cat, pattern in CATEGORIES:
        if re.search(pattern, name, re.IGNORECASE):
            return cat
    return "other"


def union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total / 1e3


def gaps(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    out, end = [], lo
    for s, e in sorted(intervals):
        if s > end:
            out.append((end, s))
        end = max(end, e)
    if hi > end:
        out.append((end, hi))
    return out


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def summarize(path: str, n_gaps: int) -> None:
    """The whole trace; with several profiled steps also the last one alone (from its
    forward's first kernel on), where the host ran ahead of the device."""
    ev = load(path)
    gpu = [e for e in ev if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        print(f"## {path}: no GPU events")
        return
    regions = [e for e in ev if e.get("ph") == "X" and e.get("cat") == "gpu_user_annotation" and e["name"] in REGIONS]
    _summarize_window(path, gpu, regions, n_gaps)
    forwards = sorted(r["ts"] for r in regions if r["name"] == REGIONS[0])
    if len(forwards) > 1:
        last = forwards[-1]
        _summarize_window(f"{path} (last step)", [e for e in gpu if e["ts"] >= last],
                          [r for r in regions if r["ts"] >= last], n_gaps)


def _summarize_window(path: str, gpu: list[dict], regions: list[dict], n_gaps: int) -> None:
    lo, hi = min(e["ts"] for e in gpu), max(e["ts"] + e["dur"] for e in gpu)
    streams: dict[int, list[dict]] = {}
    for e in gpu:
        streams.setdefault(e.get("args", {}).get("stream", e.get("tid")), []).append(e)
    print(f"## {path}: GPU window {(hi - lo) / 1e3:.1f} ms, {len(gpu)} kernels/copies")
    busy = {}
    for sid, es in streams.items():
        busy[sid] = union_ms([(e["ts"], e["ts"] + e["dur"]) for e in es])
        nccl = sum(1 for e in es if "nccl" in e["name"].lower())
        print(f"  stream {sid!s:>4}: {len(es):5d} events, busy {busy[sid]:8.1f} ms ({nccl} nccl)")
    compute = max(streams, key=lambda s: sum(e["dur"] for e in streams[s] if "nccl" not in e["name"].lower()))
    iv = [(e["ts"], e["ts"] + e["dur"]) for e in streams[compute]]
    idle = gaps(iv, lo, hi)
    print(f"  compute stream {compute}: busy {busy[compute]:.1f} ms, idle {sum(b - a for a, b in idle) / 1e3:.1f} ms")
    for r in regions:
        r_lo, r_hi = r["ts"], r["ts"] + r["dur"]
        inside = [(max(a, r_lo), min(b, r_hi)) for a, b in idle if b > r_lo and a < r_hi]
        print(f"    {r['name']:<14s} {r['dur'] / 1e3:8.1f} ms on the GPU timeline, compute idle "
              f"{sum(b - a for a, b in inside) / 1e3:7.1f} ms")
    by_cat: dict[str, list[float]] = {}
    for e in gpu:
        c = by_cat.setdefault(category(e["name"]), [0, 0.0])
        c[0] += 1
        c[1] += e["dur"] / 1e3
    print("  kernel time by category (all streams; nccl includes waiting for peers):")
    for cat, (n, ms) in sorted(by_cat.items(), key=lambda kv: -kv[1][1]):
        print(f"    {cat:<18s} x{n:<5d} {ms:8.1f} ms")
    print(f"  longest compute-stream gaps (ms after window start: length, next kernel):")
    starts = sorted(streams[compute], key=lambda e: e["ts"])
    for a, b in sorted(idle, key=lambda g: g[0] - g[1])[:n_gaps]:
        nxt = next((e["name"] for e in starts if e["ts"] >= b), "-")
        print(f"    {(a - lo) / 1e3:8.1f}: {(b - a) / 1e3:6.2f} ms  {nxt[:90]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--gaps", type=int, default=8)
    args = ap.parse_args()
    for path in args.traces:
        summarize(path, args.gaps)


if __name__ == "__main__":
    main()
