"""``python -m hybrid_dist.launch.plot`` writes a valid PNG from metrics JSONL files."""

from __future__ import annotations

import json
import math
import struct

import pytest

from hybrid_dist.launch import plot


def _write_run(path, name, losses, tps):
    with open(path, "w") as f:
        f.write(json.dumps({"event": "start", "name": name, "start_step": 0, "entropy_floor": 1.08}) + "\n")
        for i, loss in enumerate(losses, 1):
            dt = 3.0 if i == 1 else 0.5  # the first (warm-up) step is slow and left out
            f.write(json.dumps({"event": "step", "step": i, "loss": loss, "tokens": tps * dt, "tokens_per_s": tps,
                                "step_time_s": dt}) + "\n")
        f.write(json.dumps({"event": "summary", "final_loss": losses[-1]}) + "\n")


def test_plot_writes_png(tmp_path):
    runs = []
    for j, name in enumerate(("bf16", "mxfp8_fwd_nvfp4_bwd")):
        p = tmp_path / f"{name}.jsonl"
        _write_run(p, name, [6.2 * math.exp(-0.05 * i) + 1.1 + 0.01 * j for i in range(50)], 500.0 + 100 * j)
        runs.append(str(p))
    out = tmp_path / "sub" / "runs.png"
    assert plot.main([*runs, "--out", str(out), "--title", "tiny"]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1440, 540), (width, height)  # 12 x 4.5 inches at 120 dpi
    assert len(data) > 20_000, len(data)
    assert data[-8:-4] == b"IEND"


def test_load_run_reads_losses_and_mean_throughput(tmp_path):
    p = tmp_path / "r.jsonl"
    _write_run(p, "r", [5.0, 4.0, 3.0], 400.0)
    run = plot.load_run(str(p))
    assert run["losses"] == [5.0, 4.0, 3.0] and run["steps"] == [1, 2, 3]
    assert run["tokens_per_s"] == 400.0 and run["name"] == "r" and run["entropy_floor"] == 1.08


def test_plot_rejects_file_without_steps(tmp_path):
    p = tmp_path / "empty.jsonl"
    p.write_text(json.dumps({"event": "start", "name": "x"}) + "\n")
    with pytest.raises(ValueError, match="no step records"):
        plot.load_run(str(p))


def test_load_run_takes_a_resumed_runs_steps_once(tmp_path):
    """A run killed after logging step 5 and resumed from its step-3 checkpoint appends a
    ``start`` record with ``start_step`` 3: steps 4 and 5 come from the resumed run, once."""
    p = tmp_path / "r.jsonl"
    _write_run(p, "r", [5.0, 4.0, 3.0, 2.5, 2.4], 400.0)
    with open(p, "a") as f:
        f.write(json.dumps({"event": "start", "name": "r", "start_step": 3}) + "\n")
        for step, loss in ((4, 2.6), (5, 2.3), (6, 2.2)):
            f.write(json.dumps({"event": "step", "step": step, "loss": loss, "tokens": 200, "tokens_per_s": 400.0,
                                "step_time_s": 0.5}) + "\n")
    run = plot.load_run(str(p))
    assert run["steps"] == [1, 2, 3, 4, 5, 6], run["steps"]
    assert run["losses"] == [5.0, 4.0, 3.0, 2.6, 2.3, 2.2], run["losses"]
    assert run["entropy_floor"] == 1.08  # from the fresh run's start record
