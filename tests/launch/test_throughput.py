"""Throughput plumbing of the launcher: ``--layers``, ``--baseline torchao-float8`` option
checks, warm-up steps left out of the summary's tokens/s, and the table of
``benchmarks.throughput``."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from torch import nn

from benchmarks import throughput
from hybrid_dist.launch.config import TrainConfig, parse_args
from hybrid_dist.launch.metrics import Meter, timed_tokens_per_s
from hybrid_dist.launch.model import Transformer
from hybrid_dist.launch.presets import preset


def test_layers_override_changes_depth_only():
    cfg, _ = parse_args(["--preset", "8b", "--layers", "4"])
    m = preset(cfg.preset, layers=cfg.layers)
    full = preset("8b")
    assert (m.n_layers, m.dim, m.ffn_dim, m.vocab_size) == (4, full.dim, full.ffn_dim, full.vocab_size)
    per_layer = (full.num_params(embeddings=False) - full.dim) // 32
    assert full.num_params() - m.num_params() == 28 * per_layer
    assert preset("8b", layers=0) == full
    with pytest.raises(ValueError, match="--layers must be >= 1"):
        TrainConfig(layers=-1)


@pytest.mark.parametrize("kw, exc, pattern", [
    (dict(baseline="torchao-float8", recipe="fp8_current"), ValueError,
     r"needs --recipe bf16.*got --recipe fp8_current"),
    (dict(baseline="torchao-float8", quantized_init=True), NotImplementedError, r"--quantized-init"),
    (dict(baseline="torchao-float8", moe_experts=4), NotImplementedError, r"--moe-experts"),
    (dict(baseline="torchao-fp8"), ValueError, r"unknown; choose one of none, torchao-float8"),
], ids=["recipe", "quantized_init", "moe", "unknown"])
def test_baseline_option_checks(kw, exc, pattern):
    with pytest.raises(exc, match=pattern):
        TrainConfig(**kw)


def test_torchao_missing_raises_clear_import_error(monkeypatch):
    from hybrid_dist.launch import torchao_baseline

    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # what `import` sees without torchao
    with pytest.raises(ImportError, match=r"--baseline torchao-float8 needs torchao.*pip install torchao"):
        torchao_baseline.check_available()


def test_torchao_converts_block_linears_not_the_head():
    pytest.importorskip("torchao.float8")
    from hybrid_dist.launch import torchao_baseline

    model = Transformer(preset("tiny"), linear=nn.Linear)
    torchao_baseline.convert(model)
    names = {n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    assert len(names) == 2 * 7 and "output" not in names, sorted(names)
    w = model.layers["0"].attention.wq.weight
    assert torchao_baseline.is_float8_weight(w), type(w)  # gathered as float8 by FSDP2
    with pytest.raises(RuntimeError, match="no nn.Linear was converted"):
        torchao_baseline.convert(Transformer(preset("tiny")))  # hd.Linear blocks: nothing to convert


def test_summary_leaves_out_warmup_steps(tmp_path):
    meter = Meter(total_steps=5, flops_per_token=1, world_size=1, device=torch.device("cpu"), rank=0,
                  jsonl_path=str(tmp_path / "m.jsonl"), log_every=1, quiet=True, run={}, ag_bytes_per_step=None,
                  ag_measured=False, timing_warmup=2)
    for step in range(1, 6):
        meter.exclude(1e3)  # batch generation: left out of the step time
        meter.step(step, 1.0, 1000, 0.1)
    assert all(r["data_time_s"] == 1e3 and r["step_time_s"] < 1.0 for r in meter.records), meter.records
    # replace the measured times: two slow warm-up steps (compile), then 0.5 s per 1000 tokens
    for rec, dt in zip(meter.records, (30.0, 5.0, 0.5, 0.5, 0.5)):
        rec["step_time_s"] = dt
    s = meter.finish({})
    assert s["timed_steps"] == [3, 4, 5]
    assert s["tokens_per_s"] == pytest.approx(2000.0)
    assert timed_tokens_per_s(meter.records, 0) == pytest.approx(5000 / 36.5)
    assert timed_tokens_per_s(meter.records[:2], 2) == pytest.approx(200.0)  # too few steps: the last one


def test_progress_line_fits_100_columns_with_elapsed_and_remaining_time(capsys, monkeypatch):
    import time

    now = time.perf_counter()
    monkeypatch.setattr(time, "perf_counter", lambda: now)  # the clock stands still: exactly 40 s elapsed
    meter = Meter(total_steps=99999, flops_per_token=10**9, world_size=1, device=torch.device("cpu"), rank=0,
                  jsonl_path=None, log_every=1, quiet=False, run={}, ag_bytes_per_step=123 * 2**30,
                  ag_measured=False)
    meter.peak = 1e15  # as on a GPU: the MFU column is filled
    meter._t0 -= 40.0  # a 40 s first step: 99,998 steps of 40 s left
    meter._t_last -= 40.0
    meter.step(1, 12.3456, 9_999_999, 0.1)
    line = capsys.readouterr().out.strip()
    assert len(line) <= 100, (len(line), line)
    assert line.startswith("step     1/99999  loss 12.3456") and "AG 123.0G~" in line, line
    assert line.endswith("0:40<1111:05:20"), line  # 99,998 x 40 s


def _write(path, start, tps=None, steps=3, ag=None, ag_est=None, mode="w"):
    with open(path, mode) as f:
        f.write(json.dumps({"event": "start", "fsdp": 4, **start}) + "\n")
        for i in range(1, steps + 1):
            rec = {"event": "step", "step": i, "loss": 1.0, "peak_mem_bytes": 10 * 2**30}
            rec.update({"ag_bytes": ag} if ag is not None else {"ag_bytes_est": ag_est})
            f.write(json.dumps(rec) + "\n")
        if tps is not None:
            cs = {"compile_stats": {"graphs": 1, "graph_breaks": 0}} if start.get("compile") else {}
            f.write(json.dumps({"event": "summary", "tokens_per_s": tps, "mfu": tps / 1e5,
                                "peak_mem_bytes": 20 * 2**30, **cs}) + "\n")


def test_throughput_table(tmp_path):
    base = {"preset": "8b", "n_layers": 32, "baseline": "none"}
    runs = {
        "a_fp8q": ({**base, "recipe": "fp8_current", "quantized_init": True}, 1300.0, dict(ag=2**30)),
        "b_bf16": ({**base, "recipe": "bf16"}, 1000.0, dict(ag_est=2 * 2**30)),
        "c_tao": ({**base, "recipe": "bf16", "baseline": "torchao-float8", "compile": True}, 1500.0,
                  dict(ag_est=2**30)),
        "d_bf16c": ({**base, "recipe": "bf16", "compile": True}, 1200.0, dict(ag_est=2 * 2**30)),
        "e_nvfp4": ({**base, "recipe": "nvfp4"}, None, dict(ag_est=2 * 2**30)),  # crashed: no summary
        "f_moe": ({"preset": "1b", "n_layers": 4, "recipe": "bf16", "moe_experts": 8, "moe_top_k": 2}, 500.0,
                  dict(ag_est=2**20)),
        "g_skip": ({"preset": "1b", "recipe": "mxfp8", "moe_experts": 8, "status": "skipped"}, None,
                   dict(ag_est=None)),
    }
    paths = []
    for name, (start, tps, ag) in runs.items():
        p = tmp_path / f"{name}.jsonl"
        if name == "b_bf16":  # an older run in the same file: the last one counts
            _write(p, {"name": name, **start}, 1.0, ag_est=1)
        _write(p, {"name": name, **start}, tps, steps=0 if name == "g_skip" else 3, mode="a", **ag)
        paths.append(str(p))
    rows = throughput.table_rows([throughput.load_last_run(p) for p in paths])
    got = {(r[0], r[1]): r[2:] for r in rows}
    assert got[("8b fsdp4", "bf16")] == ["1,000", "1.0%", "20.0", "~2.00 GiB", "", "1.00", "0.67", "—"]
    assert got[("8b fsdp4", "fp8_current +qinit")] == ["1,300", "1.3%", "20.0", "1.00 GiB", "", "1.30", "0.87", "—"]
    assert got[("8b fsdp4", "bf16 +compile")][-3:] == ["1.00", "0.80", "—"]  # compiled runs: compiled bf16
    assert got[("8b fsdp4", "torchao-float8 +compile")] == ["1,500", "1.5%", "20.0", "~1.00 GiB", "1/0", "1.25",
                                                           "1.00", "—"]
    assert got[("8b fsdp4", "nvfp4 (failed)")] == ["—", "—", "10.0", "~2.00 GiB", "", "—", "—", "—"]
    assert got[("1b moe8top2 L4 fsdp4", "bf16")][-5:] == ["~1.00 MiB", "", "1.00", "—", "—"]
    assert got[("1b moe8top2 fsdp4", "mxfp8 (skipped)")] == ["—", "—", "—", "—", "", "—", "—", "—"]
    # one table: header, separator, one row per run; 8b rows first (file order), eager before compiled
    table = throughput.format_table([throughput.load_last_run(p) for p in paths]).splitlines()
    assert table[0] == ("| preset | recipe | tokens/s | MFU | peak GiB | all-gather/step | graphs/breaks | × bf16 "
                        "| × torchao | host ms fwd/bwd/opt of step |")
    assert len(table) == 2 + len(runs)
    order = [line.split(" | ")[1] for line in table[2:6]]
    assert order == ["bf16", "fp8_current +qinit", "nvfp4 (failed)", "bf16 +compile"], order
    # the host column: mean host ms per region over the timed steps, and their step time
    summary = {"host_ms": {"forward": 100.4, "backward": 180.6, "optimizer": 9.5}, "timed_steps": [3, 4]}
    steps = [{"step": s, "step_time_s": t} for s, t in ((2, 9.0), (3, 0.19), (4, 0.21))]
    assert throughput._host(summary, steps) == "100/181/10 of 200"


def test_throughput_table_over_rounds(tmp_path):
    """``ROUNDS=3``: one row per configuration, the median tokens/s of the finished rounds and
    the median of the per-round ratios (each against its own round's reference)."""
    base = {"preset": "1b", "n_layers": 16, "baseline": "none", "compile": True}
    tps = {"bf16": (1000.0, 1100.0, 900.0), "hd": (1000.0, 800.0, None), "tao": (500.0, 1000.0, 1000.0)}
    starts = {"bf16": {**base, "recipe": "bf16"}, "hd": {**base, "recipe": "fp8_current", "quantized_init": True},
              "tao": {**base, "recipe": "bf16", "baseline": "torchao-float8"}}
    paths = []
    for k in range(3):
        for name in ("bf16", "hd", "tao"):
            p = tmp_path / f"thr_1b_{name}.r{k + 1}.jsonl"
            _write(p, {"name": name, **starts[name]}, tps[name][k], ag_est=2**30)
            paths.append(str(p))
    rows = throughput.table_rows([throughput.load_last_run(p) for p in paths])
    got = {r[1]: (r[2], r[7], r[8]) for r in rows}
    assert len(rows) == 3, rows
    assert got["bf16 +compile"] == ("1,000 (n=3)", "1.00 [1.00, 1.00]", "1.10 [0.90, 2.00]")
    # hd: rounds 1 and 2 finished (round 3 crashed): x bf16 1.00 and 0.73, x torchao 2.00 and 0.80
    assert got["fp8_current +qinit +compile"] == ("900 (n=2)", "0.86 [0.73, 1.00]", "1.40 [0.80, 2.00]")
    assert got["torchao-float8 +compile"][0] == "1,000 (n=3)"


def test_model_label_names_tp_and_ep_where_used():
    start = {"preset": "8b", "n_layers": 16, "batch_size": 1, "seq_len": 8192, "fsdp": 2}
    assert throughput.model_label({**start, "tp": 2}) == "8b L16 1×8192 fsdp2 tp2"
    assert throughput.model_label({**start, "tp": 1, "ep": 1}) == "8b L16 1×8192 fsdp2"
    moe = {**start, "moe_experts": 8, "moe_top_k": 2, "ep": 4}
    assert throughput.model_label(moe) == "8b moe8top2 L16 1×8192 fsdp2 ep4"
    assert throughput.model_label({**start, "reshard_after_forward": "never"}) == "8b L16 1×8192 fsdp2 reshard-never"
    assert throughput.model_label({**start, "reshard_after_forward": "default"}) == "8b L16 1×8192 fsdp2"
    assert throughput.model_label({**start, "fsdp_unit": 2}) == "8b L16 1×8192 fsdp2 unit2"
    assert throughput.model_label({**start, "fsdp_prefetch": 1}) == "8b L16 1×8192 fsdp2 prefetch1"
