"""``--inspect-every`` under a real ``torchrun`` (2 gloo ranks): with FSDP2, quantized init
and ``--compile``, a weight's statistics are of the gathered (full) tensor (rank 0 writes
the records, of its own batch's activations and gradients), and the compiled step keeps one graph with statistics and one without; with
tensor parallelism the operands a rank holds only a shard of are labelled ``"shard"``."""

from __future__ import annotations

import json
import subprocess
import sys

from tests._tiers import slow

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
TRAIN = ["-m", "hybrid_dist.launch.train", "--preset", "tiny", "--steps", "3", "--inspect-every", "2"]
DIM = 256  # the tiny preset's model width


def _run(args: list[str], path) -> tuple[list[dict], dict]:
    out = subprocess.run([*TORCHRUN, *TRAIN, *args, "--metrics", str(path)], capture_output=True, text=True,
                         timeout=600, check=False)
    assert out.returncode == 0, (args, out.stderr[-3000:])
    with open(path) as f:
        events = [json.loads(line) for line in f]
    inspects = [e for e in events if e.get("event") == "inspect"]
    summary = [e for e in events if e.get("event") == "summary"][-1]
    return inspects, summary


def _row(records, module, tensor_type, direction):
    return next(r for r in records if r["used"] and (r["module"], r["tensor_type"], r["direction"])
                == (module, tensor_type, direction))


@slow
def test_fsdp2_compiled_statistics_are_of_full_weights(tmp_path):
    inspects, summary = _run(["--fsdp", "2", "--recipe", "fp8_current", "--quantized-init", "--compile"],
                             tmp_path / "fsdp.jsonl")
    # steps 1 and 2 inspected, step 3 not: one graph with statistics, one without
    assert summary["compile_stats"] == {"graphs": 2, "graph_breaks": 0}, "config: fsdp 2, qinit, compile"
    assert [(e["step"], e["rank"]) for e in inspects] == [(1, 0), (2, 0)]
    for e in inspects:
        w = _row(e["records"], "layers.0.attention.wq", "weight", "rowwise")
        assert w["numel"] == DIM * DIM and w["scope"] == "full", (e["rank"], w)


@slow
def test_tensor_parallel_statistics_label_shards(tmp_path):
    inspects, _ = _run(["--tp", "2", "--recipe", "mxfp8"], tmp_path / "tp.jsonl")
    records = [r for e in inspects if e["rank"] == 0 for r in e["records"]]
    scopes = {r["scope"] for r in records}
    assert scopes == {"full", "shard"}, f"config: tp 2, mxfp8: scopes {scopes}"
    w = _row(records, "layers.0.attention.wq", "weight", "rowwise")  # column-parallel: half the rows
    assert w["numel"] == DIM * DIM // 2 and w["scope"] == "shard", w
