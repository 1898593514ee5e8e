"""``--inspect-every``: the metrics JSONL's inspect lines (schema and content), the plot's
heatmap PNG, and the advisor's recipe, which loads through ``--recipe PATH:recipe`` and
trains."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest

import hybrid_dist as hd
from hybrid_dist.inspection import CANDIDATES
from hybrid_dist.launch import advise, plot
from hybrid_dist.launch.config import load_recipe
from hybrid_dist.launch.inspect_records import COLUMNS, RECORD_KEYS, load_inspect
from hybrid_dist.launch.inspect_stats import is_inspect_step
from tests._tiers import slow

TINY_LINEARS = 2 * 7  # tiny preset: 2 blocks of wq, wk, wv, wo, w1, w3, w2


def _train(args: list[str], cwd) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-m", "hybrid_dist.launch.train", "--preset", "tiny", "--quiet", *args],
                         env=env, cwd=cwd, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.fixture(scope="module")
def run_jsonl(tmp_path_factory):
    d = tmp_path_factory.mktemp("inspect")
    path = d / "run.jsonl"
    _train(["--recipe", "mxfp8_fwd_nvfp4_bwd", "--steps", "3", "--inspect-every", "3", "--metrics", str(path)], d)
    return str(path)


def test_inspect_steps():
    assert [s for s in range(1, 11) if is_inspect_step(s, every=4, start=0)] == [1, 4, 8]
    assert [s for s in range(6, 11) if is_inspect_step(s, every=4, start=5)] == [6, 8]
    assert not any(is_inspect_step(s, every=0, start=0) for s in range(1, 10))


def test_jsonl_schema(run_jsonl):
    start, events = load_inspect(run_jsonl)
    assert start["inspect_every"] == 3 and [e["step"] for e in events] == [1, 3]
    for e in events:
        assert set(e) == {"event", "step", "rank", "records"} and e["rank"] == 0
        recs = e["records"]
        assert all(set(r) == set(RECORD_KEYS) for r in recs)
        used = {(r["module"], r["tensor_type"], r["direction"]): r for r in recs if r["used"]}
        assert len(used) == TINY_LINEARS * len(COLUMNS)  # every operand direction of every hd.Linear, once
        wq = used[("layers.0.attention.wq", "input", "rowwise")]
        assert wq["format"] == "mxfp8" and wq["gemm"] == "fprop" and wq["scope"] == "full"
        assert used[("layers.0.attention.wq", "grad_output", "columnwise")]["format"] == "nvfp4_rht_sr"
        for r in recs:
            assert r["numel"] > 0 and 0 <= r["underflow"] <= 1 and 0 <= r["saturated"] <= 1
            assert r["amax"] > 0 and (r["sqnr_db"] is None or 5 < r["sqnr_db"] < 60), r
            assert isinstance(r["scale_hist"]["log2_lo"], int) and sum(r["scale_hist"]["counts"]) > 0
        # MXFP8 (8-bit elements) keeps about 11 dB more than NVFP4 on the same tensor
        mx = [r["sqnr_db"] for r in recs if r["format"] == "mxfp8"]
        nv = [r["sqnr_db"] for r in recs if r["format"].startswith("nvfp4") and not r["format"].endswith("sr")]
        assert min(mx) > max(nv) + 5, (min(mx), max(nv))


def _png_size(path) -> tuple[int, int]:
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and data[-8:-4] == b"IEND"
    return struct.unpack(">II", data[16:24])


@pytest.mark.parametrize("args", [[], ["--stat", "underflow", "--format", "nvfp4", "--inspect-step", "1"]])
def test_plot_draws_heatmap(run_jsonl, tmp_path, args):
    out = tmp_path / "run.png"
    assert plot.main([run_jsonl, "--out", str(out), *args]) == 0
    w, h = _png_size(out)
    assert w == 1440 and h > 540 + 400, (w, h)  # the loss row (540 px at 120 dpi) and a heatmap below
    with pytest.raises(SystemExit):
        plot.main([run_jsonl, "--out", str(out), "--stat", "mse"])


def test_advisor_recipe_round_trips(run_jsonl, tmp_path):
    prefix = str(tmp_path / "advised")
    assert advise.main([run_jsonl, "--min-sqnr", "25", "--out", prefix]) == 0
    text = open(prefix + ".txt").read()
    assert "choices: nvfp4 0, mxfp8 84, high_precision 0" in text  # NVFP4 stays near 20 dB, MXFP8 near 31
    _png_size(prefix + ".png")
    recipe = load_recipe(f"{prefix}.py:recipe")
    assert isinstance(recipe, hd.Recipe) and recipe.name.startswith("advised_")
    role = hd.Role(tensor_type="input", name="layers.1.feed_forward.w2")
    assert recipe.quantizer(role) == CANDIDATES["mxfp8"]["input"]
    assert recipe.quantizer(hd.Role(tensor_type="weight", name="output")) == hd.IdentityQuantizer()
    # thresholds that take every cell to one end, and one between (both formats, hybrids)
    assert advise.main([run_jsonl, "--min-sqnr", "60", "--out", prefix + "_hp"]) == 0
    assert load_recipe(f"{prefix}_hp.py:recipe").quantizer(role) == hd.IdentityQuantizer()
    assert advise.main([run_jsonl, "--min-sqnr", "15", "--max-underflow", "1", "--out", prefix + "_nv"]) == 0
    assert load_recipe(f"{prefix}_nv.py:recipe").quantizer(role) == CANDIDATES["nvfp4"]["input"]
    assert advise.main([run_jsonl, "--min-sqnr", "18", "--out", prefix + "_mixed"]) == 0
    mixed = load_recipe(f"{prefix}_mixed.py:recipe")
    plan = advise_plan(f"{prefix}_mixed.py")
    pick = {"high_precision": lambda t: hd.IdentityQuantizer(), **{c: (lambda t, c=c: CANDIDATES[c][t]) for c in CANDIDATES}}
    for (name, tensor_type), (row, col) in plan.items():
        want = pick[row](tensor_type) if row == col else \
            hd.HybridQuantizer(rowwise=pick[row](tensor_type), columnwise=pick[col](tensor_type))
        assert mixed.quantizer(hd.Role(tensor_type=tensor_type, name=name)) == want, (name, tensor_type)
    assert len({v for v in plan.values()}) > 1 and any(r != c for r, c in plan.values())
    # and it trains through the launcher's --recipe
    metrics = tmp_path / "advised.jsonl"
    _train(["--recipe", f"{prefix}.py:recipe", "--steps", "2", "--metrics", str(metrics)], tmp_path)
    first = json.loads(open(metrics).readline())
    assert first["recipe"] == recipe.name


def advise_plan(path: str) -> dict:
    import importlib.util
    spec = importlib.util.spec_from_file_location("advised_plan", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.PLAN


def test_recipe_path_errors(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load_recipe(f"{tmp_path}/missing.py:recipe")
    f = tmp_path / "r.py"
    f.write_text("import hybrid_dist as hd\nrecipe = hd.recipe_from_name('mxfp8')\nnot_a_recipe = 3\n")
    assert load_recipe(f"{f}:recipe").name == "mxfp8"
    with pytest.raises(ValueError, match="has no attribute 'other'.*recipe"):
        load_recipe(f"{f}:other")
    with pytest.raises(ValueError, match="gave int"):
        load_recipe(f"{f}:not_a_recipe")
    with pytest.raises(ValueError, match="cannot import 'no_such_pkg.mod'"):
        load_recipe("no_such_pkg.mod:recipe")


def test_advise_without_statistics_is_an_error(tmp_path, capsys):
    p = tmp_path / "plain.jsonl"
    p.write_text(json.dumps({"event": "start", "name": "x", "start_step": 0}) + "\n")
    assert advise.main([str(p)]) == 2
    assert "no inspect records" in capsys.readouterr().err


def test_inspect_needs_metrics():
    from hybrid_dist.launch.config import TrainConfig
    with pytest.raises(ValueError, match="--inspect-every 5 writes to the metrics file"):
        TrainConfig(inspect_every=5)


def _events(path, kind: str) -> list[dict]:
    with open(path) as f:
        return [e for e in map(json.loads, f) if e.get("event") == kind]


@slow
def test_compiled_run_with_statistics_trains_like_without(tmp_path):
    """``--compile`` (Inductor) with statistics: two graphs per block structure (with and
    without), no graph break, every inspect step recorded, and the losses of the run without
    statistics, bitwise."""
    plain, inspected = tmp_path / "plain.jsonl", tmp_path / "inspected.jsonl"
    common = ["--compile", "--recipe", "fp8_current", "--steps", "3"]
    _train([*common, "--metrics", str(plain)], tmp_path)
    _train([*common, "--inspect-every", "2", "--metrics", str(inspected)], tmp_path)
    assert [e["loss"] for e in _events(inspected, "step")] == [e["loss"] for e in _events(plain, "step")]
    summary = _events(inspected, "summary")[-1]
    assert summary["compile_stats"] == {"graphs": 2, "graph_breaks": 0}
    _, events = load_inspect(str(inspected))
    assert [e["step"] for e in events] == [1, 2]
    assert all(len([r for r in e["records"] if r["used"]]) == TINY_LINEARS * len(COLUMNS) for e in events)


def test_moe_experts_have_rows(tmp_path):
    """``--moe-experts 4``: each GroupedLinear (fc1, fc2 of both blocks) has one row per
    operand direction in the recipe's format, its experts combined."""
    path = tmp_path / "moe.jsonl"
    _train(["--moe-experts", "4", "--recipe", "mxfp8", "--steps", "1", "--inspect-every", "1",
            "--metrics", str(path)], tmp_path)
    _, events = load_inspect(str(path))
    used = {(r["module"], r["tensor_type"], r["direction"]): r for r in events[0]["records"] if r["used"]}
    moe = {k: r for k, r in used.items() if ".moe." in k[0]}
    assert {k[0] for k in moe} == {f"layers.{i}.feed_forward.moe.{f}" for i in (0, 1) for f in ("fc1", "fc2")}
    assert len(moe) == 4 * len(COLUMNS) and all(r["format"] == "mxfp8" and r["numel"] > 0 for r in moe.values())
