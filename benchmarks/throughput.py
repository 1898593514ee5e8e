"""Throughput table of ``launch.train`` runs: ``python -m benchmarks.throughput RUN.jsonl ...``.

Reads metrics JSONL files written by ``torchrun ... -m hybrid_dist.launch.train --metrics F``
(``benchmarks/run_throughput_gpu.sh`` writes one per run) and prints ONE markdown table,
one row per run, grouped by model:

- preset: from the ``start`` record: the preset, ``moe<E>top<k>`` for MoE, ``L<n>`` when
  ``--layers`` changed the depth, tokens per GPU as ``batch×seq``, ``fsdp<N>`` (and
  ``tp<N>`` / ``ep<N>`` where used, ``reshard-<policy>`` for another
  ``--reshard-after-forward`` than the default, ``unit<N>`` for ``--fsdp-unit N``,
  ``prefetch<N>`` for ``--fsdp-prefetch N``);
- recipe: the recipe or the baseline (``torchao-float8``), ``+qinit`` (``--quantized-init``),
  ``+compile``;
- tokens/s: from the ``summary`` record: all ranks' tokens / time over the timed steps
  (the first ``--timing-warmup`` steps and the synthetic batch generation left out);
- MFU: the summary's model FLOP/s ÷ (ranks × dense bf16 peak); ``n/a`` off known GPUs;
- peak GiB: the summary's peak memory of rank 0 during training;
- all-gather/step: the last step's all-gather output bytes per rank, measured for
  quantized parameters (``hybrid_dist.fsdp2``), else estimated (``~``);
- graphs/breaks: for compiled runs, the graphs Dynamo compiled and its graph breaks;
- host ms fwd/bwd/opt of step: the summary's mean host time per timed step issuing the
  forward, backward and optimizer (``host_ms``), and the step time: when their sum is close
  to the step time, the host bounds the step;
- × bf16: tokens/s ÷ that of the ``bf16`` run (no baseline, no ``--quantized-init``) of the
  same model, with the same ``--compile`` setting when there is one;
- × torchao: tokens/s ÷ that of the compiled torchao float8 run of the same model.

Runs repeated in rounds (``ROUNDS=N`` in ``run_throughput_gpu.sh``: every configuration
once per round, in turn; files ``NAME.r<k>.jsonl``) give one row per configuration: the
median tokens/s over the rounds that finished, ``(n=k)`` the number of those rounds, and
as ratios the median of the per-round ratios (each against the reference of the same
round) with their ``[min, max]``; the other columns are those of the median run.

A file whose last run has no ``summary`` (it crashed or timed out) gives a row of ``—``
marked ``failed`` (or with the ``status`` of a stub ``start`` record that
``run_throughput_gpu.sh`` writes for runs it skipped), so a partial benchmark still prints
every configuration it tried.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys

from hybrid_dist.launch.presets import PRESETS


def load_last_run(path: str) -> dict:
    """``{"start", "steps", "summary"}`` of the last run appended to ``path`` (``summary``
    is None when that run did not finish)."""
    runs: list[dict] = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            rec = json.loads(line)
            event = rec.get("event")
            if event == "start" or not runs:
                runs.append({"start": rec if event == "start" else {}, "steps": [], "summary": None})
            if event == "step":
                runs[-1]["steps"].append(rec)
            elif event == "summary":
                runs[-1]["summary"] = rec
    if not runs:
        raise ValueError(f"{path}: no records; pass metrics files written by launch.train --metrics")
    m = re.search(r"\.r(\d+)\.jsonl$", path)
    return {**runs[-1], "path": path, "round": int(m.group(1)) if m else None}


def model_label(start: dict) -> str:
    preset = start.get("preset", "?")
    label = preset
    if start.get("moe_experts"):
        label += f" moe{start['moe_experts']}top{start.get('moe_top_k', 2)}"
    n_layers = start.get("n_layers")
    if preset in PRESETS and n_layers and n_layers != PRESETS[preset].n_layers:
        label += f" L{n_layers}"
    if start.get("batch_size") and start.get("seq_len"):
        label += f" {start['batch_size']}×{start['seq_len']}"
    label += f" fsdp{start.get('fsdp', '?')}"
    for dim in ("tp", "ep"):  # the other parallel dims, where used
        if (start.get(dim) or 1) > 1:
            label += f" {dim}{start[dim]}"
    if start.get("reshard_after_forward", "default") != "default":  # --reshard-after-forward
        label += f" reshard-{start['reshard_after_forward']}"
    if start.get("fsdp_unit", 1) != 1:  # --fsdp-unit
        label += f" unit{start['fsdp_unit']}"
    if start.get("fsdp_prefetch", 0):  # --fsdp-prefetch
        label += f" prefetch{start['fsdp_prefetch']}"
    return label


def recipe_label(start: dict) -> str:
    base = start.get("baseline", "none")
    label = base if base and base != "none" else start.get("recipe", "?")
    if start.get("quantized_init"):
        label += " +qinit"
    if start.get("compile"):
        label += " +compile"
    return label


def _is_bf16_reference(start: dict) -> bool:
    return (start.get("recipe") == "bf16" and start.get("baseline", "none") in (None, "none")
            and not start.get("quantized_init"))


def _same_round(run: dict, runs: list[dict]) -> list[dict]:
    return [r for r in runs if r.get("round") == run.get("round")]


def _bf16_tps(run: dict, runs: list[dict]) -> float | None:
    """tokens/s of the bf16 run of the same model and round (same compile setting preferred)."""
    same = [r for r in _same_round(run, runs) if r["summary"] and _is_bf16_reference(r["start"])
            and model_label(r["start"]) == model_label(run["start"])]
    match = [r for r in same if bool(r["start"].get("compile")) == bool(run["start"].get("compile"))]
    pick = (match or same)[:1]
    return pick[0]["summary"]["tokens_per_s"] if pick else None


def _torchao_tps(run: dict, runs: list[dict]) -> float | None:
    """tokens/s of the compiled torchao float8 run of the same model and round."""
    same = [r for r in _same_round(run, runs) if r["summary"] and r["start"].get("baseline") == "torchao-float8"
            and model_label(r["start"]) == model_label(run["start"])]
    return same[0]["summary"]["tokens_per_s"] if same else None


def _compiled(s: dict) -> str:
    cs = s.get("compile_stats")
    return f"{cs['graphs']}/{cs['graph_breaks']}" if cs else ""


def _gib(b) -> str:
    return f"{b / 2**30:.1f}" if b is not None else "—"


def _bytes(b: float) -> str:
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.2f} MiB"


def _ag(steps: list[dict]) -> str:
    if not steps:
        return "—"
    last = steps[-1]
    if last.get("ag_bytes") is not None:
        return _bytes(last["ag_bytes"])
    if last.get("ag_bytes_est") is not None:
        return "~" + _bytes(last["ag_bytes_est"])
    return "—"


def _host(s: dict, steps: list[dict]) -> str:
    h = s.get("host_ms")
    timed = [r for r in steps if r["step"] in set(s.get("timed_steps") or [])]
    if not h or not timed:
        return "—"
    step_ms = 1e3 * sum(r["step_time_s"] for r in timed) / len(timed)
    return f"{h['forward']:.0f}/{h['backward']:.0f}/{h['optimizer']:.0f} of {step_ms:.0f}"


def _ratio(run: dict, ref) -> str:
    """``tokens/s ÷ ref(run)`` formatted; over rounds (``run["rounds"]``) the median of the
    per-round ratios and their ``[min, max]``."""
    if "rounds" not in run:
        ref_tps = ref(run)
        return f"{run['summary']['tokens_per_s'] / ref_tps:.2f}" if ref_tps else "—"
    ratios = [r["summary"]["tokens_per_s"] / t for r in run["rounds"] if (t := ref(r))]
    if not ratios:
        return "—"
    return f"{statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}]"


def _by_configuration(runs: list[dict]) -> list[dict]:
    """Runs of several rounds merged: per configuration, its median finished run with the
    median tokens/s and ``rounds`` (its finished runs); unfinished rounds are left out
    unless none finished. Runs without a round pass through."""
    groups: dict[tuple, list[dict]] = {}
    out = []
    for r in runs:
        if r.get("round") is None:
            out.append(r)
        else:
            groups.setdefault((model_label(r["start"]), recipe_label(r["start"])), []).append(r)
    for group in groups.values():
        done = sorted((r for r in group if r["summary"]), key=lambda r: r["summary"]["tokens_per_s"])
        if not done:
            out.append(group[-1])
            continue
        rep = done[(len(done) - 1) // 2]
        median = statistics.median(r["summary"]["tokens_per_s"] for r in done)
        out.append({**rep, "summary": {**rep["summary"], "tokens_per_s": median}, "rounds": done})
    return out


def table_rows(runs: list[dict]) -> list[list[str]]:
    rows = []
    order = {label: i for i, label in enumerate(dict.fromkeys(model_label(r["start"]) for r in runs))}
    def key(r):  # by model (first appearance), eager before compiled, the bf16 reference first
        st = r["start"]
        return order[model_label(st)], bool(st.get("compile")), not _is_bf16_reference(st), recipe_label(st)

    for run in sorted(_by_configuration(runs), key=key):
        start, s = run["start"], run["summary"]
        if s is None:  # crashed, timed out, or never started (the GPU script's stub says why)
            rows.append([model_label(start), f"{recipe_label(start)} ({start.get('status', 'failed')})", "—", "—",
                         _gib(max((r.get("peak_mem_bytes") or 0 for r in run["steps"]), default=None)),
                         _ag(run["steps"]), "", "—", "—", "—"])
            continue
        mfu = f"{100 * s['mfu']:.1f}%" if s.get("mfu") is not None else "n/a"
        ratio = _ratio(run, lambda r: _bf16_tps(r, runs))
        vs_tao = _ratio(run, lambda r: _torchao_tps(r, runs))
        tps = f"{s['tokens_per_s']:,.0f}" + (f" (n={len(run['rounds'])})" if "rounds" in run else "")
        rows.append([model_label(start), recipe_label(start), tps, mfu,
                     _gib(s.get("peak_mem_bytes")), _ag(run["steps"]), _compiled(s), ratio, vs_tao,
                     _host(s, run["steps"])])
    return rows


HEADER = ["preset", "recipe", "tokens/s", "MFU", "peak GiB", "all-gather/step", "graphs/breaks", "× bf16",
          "× torchao", "host ms fwd/bwd/opt of step"]


def format_table(runs: list[dict]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|---|---|" + "---:|" * (len(HEADER) - 2)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(runs)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.throughput", description=__doc__.split("\n")[0])
    p.add_argument("paths", nargs="+", help="metrics JSONL files (launch.train --metrics)")
    args = p.parse_args(argv)
    runs = []
    for path in args.paths:
        if not os.path.exists(path):
            raise ValueError(f"{path}: no such metrics file")
        runs.append(load_last_run(path))
    print(format_table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
