"""Where the host's time goes in steady-state training steps, from py-spy samples
(``benchmarks/host_profile_gpu.sh`` records them: ``py-spy record --format raw``, gzipped).

A sampling profiler costs per sample, not per op, unlike ``torch.profiler``, whose per-op
records inflate op-heavy host code most (its cost grows with the sampling rate: keep it low).
From the collapsed stacks (``frame;frame;... count`` per line; with ``--subprocesses`` the
first frame names the process) this keeps the samples inside the launcher's ``train_step`` and
outside compilation and first calls (Dynamo, AOTAutograd, inductor and Triton compiling,
Triton loading a kernel and building its launcher, imports inside a step), splits them by
region (forward / backward / optimizer; the backward's Python runs on autograd's thread,
outside ``train_step``: its samples are the other threads' stacks with a ``backward`` frame),
and prints per region the functions with the most samples, inclusive and as the innermost
frame, as shares of all kept samples. Samples where the host blocks (a launch into a full
queue, a collective's enqueue, a synchronization) count as the function that blocked: a step
bound by its device shows them. Compare summaries of different configurations recorded the
same way.

Run: ``python -m benchmarks.spy_summary hd.txt.gz tao.txt.gz [--top 25]``.
"""

from __future__ import annotations

import argparse
import gzip
import re
from collections import Counter

COMPILING = re.compile(r"convert_frame|compile_fx|_compile_inner|aot_module|create_aot_dispatcher|codecache"
                       r"|JITFunction\._do_compile"  # Triton compiling a kernel at its first launch
                       r"|CompiledKernel\._init_handles"  # ... and loading it (its launcher built once)
                       r"|fx_codegen|lowering|scheduler\.py|autotune|async_compile"
                       # first calls: a module imported inside a step, AOTAutograd's check of
                       # custom-op aliasing on a compiled graph's first run
                       r"|_find_and_load|_AnalyzeCustomOpInputOutputMode")
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^():]*)(?::\d+)?\)$")
_OPTIMIZER = re.compile(r"(^|\.)step \(|_write_back")
_BACKWARD = re.compile(r"(^|\.)backward \(")
_ENTRY = {"<module> (train.py)", "_run_code (<frozen runpy>)", "_run_module_as_main (<frozen runpy>)",
          "main (train.py)", "train (loop.py)", "train_step (loop.py)"}  # every training sample's roots


def read_stacks(path: str) -> list[tuple[list[str], int]]:
    """``[(frames root first, samples)]`` of a raw py-spy file (``.gz`` or plain text)."""
    opener = gzip.open if path.endswith(".gz") else open
    out = []
    with opener(path, "rt") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            stack, _, count = line.rpartition(" ")
            if stack and count.isdigit():
                out.append((stack.split(";"), int(count)))
    return out


def frame_name(frame: str) -> str:
    """``function (file.py)`` without the line number and directories."""
    m = _FRAME.match(frame)
    if not m:
        return frame
    return f"{m['func']} ({m['file'].rsplit('/', 1)[-1]})"


def region(frames: list[str]) -> str | None:
    """``forward`` / ``backward`` / ``optimizer`` for a steady-state training sample, else
    None (compiling, or neither in ``train_step`` nor in a backward: other threads)."""
    text = ";".join(frames)
    if COMPILING.search(text):
        return None
    if "train_step" not in text:  # autograd's thread runs the backward's Python (hooks, compiled backward)
        return "backward" if "backward" in text else None
    names = [frame_name(f) for f in frames]
    if any(_OPTIMIZER.search(n) for n in names):
        return "optimizer"
    if any(_BACKWARD.search(n) for n in names):
        return "backward"
    return "forward"


def process_of(frames: list[str]) -> str:
    """The sampled process (py-spy's innermost ``process ...`` frame; "" without one)."""
    return next((f for f in reversed(frames) if f.startswith("process ")), "")


def _listed(name: str) -> bool:
    return not name.startswith("process ") and name not in _ENTRY


def summarize(stacks: list[tuple[list[str], int]]) -> tuple[int, dict[str, int], dict[str, Counter]]:
    """``(kept samples, samples per region, samples per function per region)``: inclusive
    under the region's name, of the innermost frame under ``"<region> self"``;
    from the processes that ran ``train_step`` (with ``--subprocesses`` py-spy's first frame
    names the process; torchrun's agent and compile workers are left out)."""
    training = {process_of(frames) for frames, _ in stacks if any("train_step" in f for f in frames)}
    per_region: dict[str, int] = Counter()
    funcs: dict[str, Counter] = {}
    kept = 0
    for frames, n in stacks:
        r = region(frames) if process_of(frames) in training else None
        if r is None:
            continue
        kept += n
        per_region[r] += n
        c = funcs.setdefault(r, Counter())
        for name in set(frame_name(f) for f in frames):
            if _listed(name):
                c[name] += n
        funcs.setdefault(r + " self", Counter())[frame_name(frames[-1])] += n
    return kept, dict(per_region), funcs


def format_summary(path: str, kept: int, per_region: dict[str, int], funcs: dict[str, Counter], top: int) -> str:
    lines = [f"## {path}: {kept} steady-state samples"]
    for r in ("forward", "backward", "optimizer"):
        n = per_region.get(r, 0)
        lines.append(f"  {r}: {100 * n / max(kept, 1):.1f}% of samples")
        for kind in ("", " self"):
            lines.append(f"   {'inclusive' if not kind else 'self (innermost frame)'}:")
            for name, k in funcs.get(r + kind, Counter()).most_common(top):
                lines.append(f"    {100 * k / max(kept, 1):5.1f}%  {name[:110]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.spy_summary", description=__doc__.split("\n")[0])
    p.add_argument("paths", nargs="+", help="py-spy raw (collapsed) files, optionally gzipped")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    for path in args.paths:
        kept, per_region, funcs = summarize(read_stacks(path))
        print(format_summary(path, kept, per_region, funcs, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
