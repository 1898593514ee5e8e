"""Where one profiled training step's GPU time goes, from its Chrome trace
(``launch.train --profile-step N [--profile-steps K] --profile-trace step.json.gz``).

Per trace (and, for several steps, the last step alone): the GPU window, each stream's busy
time (union of its kernels and copies), the compute stream's idle time per launcher region
(``hd::forward`` / ``backward`` / ``optimizer``), its longest idle gaps, and kernel time by
category. ``--host-blocks N``: the host's time per compiled block in the trace's last
forward (each ``Torch-Compiled Region`` on the forward's thread, with its N costliest calls
by name and nesting depth, per block) and FSDP2's pre-forward per call.
Compare traces of different configurations taken on the same machine.
Run: ``python -m benchmarks.trace_summary a.json.gz b.json.gz [--gaps 8] [--host-blocks 20]``.
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
HOST_CATEGORIES = ("cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver")


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
    print("  longest compute-stream gaps (ms after window start: length, next kernel):")
    starts = sorted(streams[compute], key=lambda e: e["ts"])
    for a, b in sorted(idle, key=lambda g: g[0] - g[1])[:n_gaps]:
        nxt = next((e["name"] for e in starts if e["ts"] >= b), "-")
        print(f"    {(a - lo) / 1e3:8.1f}: {(b - a) / 1e3:6.2f} ms  {nxt[:90]}")


def _nested(events: list[dict]) -> list[tuple[int, dict]]:
    """``(depth, event)`` of time-ordered host events of one thread (0: outermost)."""
    out, stack = [], []
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
            stack.pop()
        out.append((len(stack), e))
        stack.append(e)
    return out


def host_blocks(path: str, top: int, max_depth: int = 3) -> None:
    """The host's time per compiled block in the last ``hd::forward`` (see the module doc)."""
    host = [e for e in load(path) if e.get("ph") == "X" and e.get("cat") in HOST_CATEGORIES]
    forwards = [e for e in host if e["name"] == REGIONS[0] and e["cat"] == "user_annotation"]
    if not forwards:
        print(f"## {path}: no {REGIONS[0]} region on the host")
        return
    fwd = max(forwards, key=lambda e: e["ts"])
    lo, hi, tid = fwd["ts"], fwd["ts"] + fwd["dur"], fwd["tid"]
    thread = [e for e in host if e["tid"] == tid and lo <= e["ts"] and e["ts"] + e["dur"] <= hi and e is not fwd]
    blocks = [e for e in thread if e["name"].startswith("Torch-Compiled Region")]
    pre = [e["dur"] for e in thread if e["name"].startswith("FSDP::pre_forward")]
    if pre:
        print(f"## {path}: FSDP::pre_forward in the last forward: {len(pre)} calls, "
              f"{sum(pre) / len(pre):.0f} us each")
    if not blocks:
        print(f"## {path}: no compiled region in the last forward")
        return
    per: dict[tuple[int, str], list[float]] = {}
    for b in blocks:
        inside = [e for e in thread if b["ts"] <= e["ts"] and e["ts"] + e["dur"] <= b["ts"] + b["dur"] and e is not b]
        for depth, e in _nested(inside):
            if depth < max_depth:
                c = per.setdefault((depth, e["name"]), [0, 0.0])
                c[0] += 1
                c[1] += e["dur"]
    n = len(blocks)
    print(f"## {path}: host per compiled block in the last forward ({n} blocks): "
          f"{sum(b['dur'] for b in blocks) / n:.0f} us")
    for (depth, name), (count, us) in sorted(per.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"    {depth} {name[:70]:<70s} n/block {count / n:5.1f}  us/block {us / n:8.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--gaps", type=int, default=8)
    ap.add_argument("--host-blocks", type=int, default=0, metavar="N",
                    help="also the host time per compiled block of the last forward, its N costliest calls")
    args = ap.parse_args()
    for path in args.traces:
        summarize(path, args.gaps)
        if args.host_blocks:
            host_blocks(path, args.host_blocks)


if __name__ == "__main__":
    main()
